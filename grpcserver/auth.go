// SPDX-License-Identifier: Apache-2.0

package grpcserver

import (
	"bufio"
	"bytes"
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/tap"
	authnv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/mtlsbridge/mtlsbridge/api"
	"github.com/mtlsbridge/mtlsbridge/internal/logthrottle"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/enrollment"
	"github.com/mtlsbridge/mtlsbridge/tables"
	"github.com/mtlsbridge/mtlsbridge/tables/ingest"
)

// Caller is the pod a valid token belongs to.
type Caller struct {
	Namespace string
	Pod       string
	// PodUID, ServiceAccount and Node are known from a TokenReview of a
	// bound token; empty from the token file.
	PodUID         string
	ServiceAccount string
	Node           string
}

// Key is "namespace/pod".
func (c Caller) Key() string { return c.Namespace + "/" + c.Pod }

// Authenticator decides who calls, and whether they may: only the mTLS
// agent pod of this node passes (in the signer: node agents, see
// Callers). It runs as the gRPC server's tap handle, on a stream's
// headers, before the stream exists: nothing a refused caller sends is
// ever read. Every refusal is logged and counted.
type Authenticator struct {
	log       *slog.Logger
	metrics   *Metrics
	localNode tables.LocalNode
	db        *statedb.DB
	pods      statedb.Table[*tables.Pod]
	verify    func(ctx context.Context, token string) (Caller, error)
	// agent tells the pods trusted as their node's mTLS agent.
	agent func(*tables.Pod) bool
	// callers: whom the listener serves (the signer's node agents).
	callers Callers
	// logs throttles the refusal warnings strangers can cause at will.
	logs *logthrottle.Throttle
	// probe asks the API server for a review (Kubernetes mode); probeErr
	// is what the last probe found.
	probe    func(context.Context) error
	probeErr atomic.Pointer[error]
	// slots bound, per method, the requests of authenticated callers that
	// may be read at once (a compromised agent pod can send messages up to
	// the listener's size limit).
	slots map[string]chan struct{}
	// nodeCalls counts the signer's open calls per node agent's node.
	nodeCalls nodeCalls
}

// perNodeCalls bounds the calls one node agent has open at the signer, so
// that one node (root on it holds its agent's token) cannot take every
// slot of a method from the cluster's other nodes.
const perNodeCalls = 2

type nodeCalls struct {
	mu   sync.Mutex
	open map[string]int
}

// acquire takes one of node's calls, if it has one left; release gives it
// back.
func (n *nodeCalls) acquire(node string) (release func(), ok bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.open[node] >= perNodeCalls {
		return nil, false
	}
	if n.open == nil {
		n.open = map[string]int{}
	}
	n.open[node]++
	return func() {
		n.mu.Lock()
		defer n.mu.Unlock()
		if n.open[node]--; n.open[node] == 0 {
			delete(n.open, node)
		}
	}, true
}

type authParams struct {
	cell.In

	Config     Config
	Log        *slog.Logger
	Metrics    *Metrics
	LocalNode  tables.LocalNode
	DB         *statedb.DB
	Pods       statedb.Table[*tables.Pod]
	Enrollment enrollment.Config
	Mode       ingest.Mode
	Clients    *ingest.Clients
	Bounds     []MethodBound `group:"grpc-method-bounds"`
	// Callers is provided in the signer only.
	Callers Callers `optional:"true"`
}

// MethodBound limits how many calls of a method are served at once.
type MethodBound struct {
	// Method is the full method name, "/package.Service/Method".
	Method string
	// Concurrent calls at most; more are refused with ResourceExhausted
	// (clients retry).
	Concurrent int
}

// MethodBoundOut adds a MethodBound.
type MethodBoundOut struct {
	cell.Out

	Bound MethodBound `group:"grpc-method-bounds"`
}

func newAuthenticator(p authParams) (*Authenticator, error) {
	a := &Authenticator{log: p.Log, metrics: p.Metrics, localNode: p.LocalNode, db: p.DB, pods: p.Pods,
		agent: p.Enrollment.MTLSAgent, callers: p.Callers, slots: map[string]chan struct{}{}, logs: logthrottle.New(time.Second)}
	for _, b := range p.Bounds {
		a.slots[b.Method] = make(chan struct{}, b.Concurrent)
	}
	switch {
	case p.Mode == ingest.Kubernetes:
		kube, err := reviewClient(p.Clients, p.Config)
		if err != nil {
			return nil, err
		}
		budget := newReviewBudget(budget{p.Config.TokenReviewQPS, p.Config.TokenReviewBurst}, peerBudget, a.isLocalAgent)
		a.verify = newReviewCache(reviewer(kube, p.Config.TokenAudiences, budget), 2*p.Config.GRPCMaxConnections).verify
		a.probe = func(ctx context.Context) error { return probeTokenReview(ctx, kube) }
	case p.Config.TokenFile != "":
		a.verify = tokenFile(p.Config.TokenFile)
	default:
		a.verify = func(context.Context, string) (Caller, error) {
			return Caller{}, refusal(codes.Unauthenticated, "no-token-source", "%v", ErrNoTokenSource)
		}
		p.Log.Warn("Folder mode without --token-file: no mTLS agent can authenticate, so none gets workloads or certificates")
	}
	return a, nil
}

// ErrNoTokenSource: folder mode without --token-file.
var ErrNoTokenSource = errors.New("folder mode without --token-file: no mTLS agent can authenticate")

// tapTimeout bounds the authentication of one stream (a TokenReview when
// the token is not cached). gRPC runs the tap in the connection's reader:
// only that connection waits.
const tapTimeout = 3 * time.Second

type callerKey struct{}

// Tap implements grpc/tap.ServerInHandle: a stream of a caller that is not
// this node's mTLS agent is refused from its headers, so its messages are
// never read (the flood: 64 calls of 15 MB without a token took
// 2.6 GB). The caller goes into the stream's context (see CallerFrom).
func (a *Authenticator) Tap(ctx context.Context, info *tap.Info) (_ context.Context, err error) {
	authCtx, cancel := context.WithTimeout(ctx, tapTimeout)
	defer cancel()
	caller, err := a.authenticate(authCtx, info.Header)
	if err != nil {
		reason := "error"
		var r *refusalError
		if errors.As(err, &r) {
			reason = r.reason
		}
		a.metrics.AuthRefused.WithLabelValues(reason).Inc()
		if suppressed, ok := a.logs.Allow(reason); ok {
			a.log.Warn("Refused gRPC caller", "method", info.FullMethodName, "reason", reason, "caller", caller.Key(),
				"peer", peerAddr(ctx), "error", err, "suppressedSinceLast", suppressed)
		}
		return nil, err
	}
	// ctx is the stream's: gRPC cancels it when the call ends, which gives
	// back what the call holds.
	if len(a.callers.NodeAgents) > 0 {
		release, ok := a.nodeCalls.acquire(caller.Node)
		if !ok {
			a.metrics.AuthRefused.WithLabelValues("node-busy").Inc()
			return nil, status.Errorf(codes.ResourceExhausted, "node %s has %d calls open here; retry", caller.Node, perNodeCalls)
		}
		defer func() {
			if err != nil {
				release()
			} else {
				context.AfterFunc(ctx, release)
			}
		}()
	}
	if slots, ok := a.slots[info.FullMethodName]; ok {
		// Never wait here: the calls holding the slots need this
		// connection's reader to receive their messages.
		select {
		case slots <- struct{}{}:
			context.AfterFunc(ctx, func() { <-slots })
		default:
			a.metrics.AuthRefused.WithLabelValues("busy").Inc()
			return nil, status.Errorf(codes.ResourceExhausted, "%d calls of %s are being served; retry", cap(slots), info.FullMethodName)
		}
	}
	return context.WithValue(ctx, callerKey{}, caller), nil
}

// CallerFrom returns the caller the tap authenticated for a stream, or an
// Unauthenticated error when none did (a server without the tap).
func CallerFrom(ctx context.Context) (Caller, error) {
	if c, ok := ctx.Value(callerKey{}).(Caller); ok {
		return c, nil
	}
	return Caller{}, status.Error(codes.Unauthenticated, "caller not authenticated")
}

func (a *Authenticator) authenticate(ctx context.Context, md metadata.MD) (Caller, error) {
	token, err := bearerToken(md)
	if err != nil {
		return Caller{}, err
	}
	caller, err := a.verify(ctx, token)
	if err != nil {
		return caller, err
	}
	_, err = a.Allowed(a.db.ReadTxn(), caller)
	return caller, err
}

// Allowed checks an authenticated caller against the tables: its pod is
// the one its token names, trusted as this node's mTLS agent, on this
// node. The channel closes when the pod's row changes: a stream that
// outlives the change checks again (a pod that is no agent any more is
// cut off, not served until it reconnects).
func (a *Authenticator) Allowed(txn statedb.ReadTxn, caller Caller) (<-chan struct{}, error) {
	if len(a.callers.NodeAgents) > 0 {
		return a.allowedNodeAgent(txn, caller)
	}
	pod, _, watch, found := a.pods.GetWatch(txn, tables.PodByKey(caller.Key()))
	switch {
	case !found:
		return watch, refusal(codes.PermissionDenied, "unknown-pod", "pod %s is not known", caller.Key())
	case !pod.MatchesUID(caller.PodUID):
		return watch, refusal(codes.PermissionDenied, "deleted-pod", "token of pod %s (uid %s) is bound to a pod that is gone: %s is now uid %s",
			caller.Key(), caller.PodUID, caller.Key(), pod.UID)
	case !a.agent(pod):
		return watch, refusal(codes.PermissionDenied, "not-mtls-agent", "pod %s is not an mTLS agent (label %s=%s, in a namespace of --mtls-agent-namespaces)",
			caller.Key(), tables.RedirTypeLabel, tables.RedirTypeProxy)
	case pod.NodeName != a.localNode.NodeName:
		return watch, refusal(codes.PermissionDenied, "other-node", "pod %s runs on node %q, not on this node %q",
			caller.Key(), pod.NodeName, a.localNode.NodeName)
	case caller.Node != "" && caller.Node != a.localNode.NodeName:
		return watch, refusal(codes.PermissionDenied, "other-node", "token of pod %s is bound to node %q, not %q",
			caller.Key(), caller.Node, a.localNode.NodeName)
	case caller.ServiceAccount != "" && caller.ServiceAccount != pod.ServiceAccountOrDefault():
		return watch, refusal(codes.PermissionDenied, "service-account-mismatch", "token of service account %q, pod %s runs as %q",
			caller.ServiceAccount, caller.Key(), pod.ServiceAccountOrDefault())
	}
	return watch, nil
}

// isLocalAgent reports whether an address belongs to an mTLS agent pod of
// this node: its token reviews have a budget of their own.
func (a *Authenticator) isLocalAgent(addr netip.Addr) bool {
	for pod := range a.pods.List(a.db.ReadTxn(), tables.PodsByIP(addr)) {
		if pod.NodeName == a.localNode.NodeName && a.agent(pod) {
			return true
		}
	}
	return false
}

func bearerToken(md metadata.MD) (string, error) {
	values := md.Get("authorization")
	if len(values) == 0 {
		return "", refusal(codes.Unauthenticated, "no-token", "no authorization metadata: want \"Bearer TOKEN\"")
	}
	token, ok := strings.CutPrefix(values[0], "Bearer ")
	if !ok || strings.TrimSpace(token) == "" {
		return "", refusal(codes.Unauthenticated, "malformed-token", "authorization metadata is not \"Bearer TOKEN\"")
	}
	return strings.TrimSpace(token), nil
}

// tokenFile checks tokens against a file of "TOKEN NAMESPACE/POD" lines,
// read at every call so that edits apply at once.
func tokenFile(path string) func(context.Context, string) (Caller, error) {
	return func(_ context.Context, token string) (Caller, error) {
		content, err := os.ReadFile(path)
		if err != nil {
			return Caller{}, refusal(codes.Unauthenticated, "token-file", "reading --token-file: %v", err)
		}
		scanner := bufio.NewScanner(bytes.NewReader(content))
		for scanner.Scan() {
			fields := strings.Fields(scanner.Text())
			if len(fields) != 2 || strings.HasPrefix(fields[0], "#") {
				continue
			}
			ns, pod, ok := strings.Cut(fields[1], "/")
			if ok && subtle.ConstantTimeCompare([]byte(fields[0]), []byte(token)) == 1 {
				return Caller{Namespace: ns, Pod: pod}, nil
			}
		}
		return Caller{}, refusal(codes.Unauthenticated, "invalid-token", "token not in --token-file")
	}
}

// Keys of a bound service account token's TokenReview user extra.
const (
	extraPodName  = "authentication.kubernetes.io/pod-name"
	extraPodUID   = "authentication.kubernetes.io/pod-uid"
	extraNodeName = "authentication.kubernetes.io/node-name"
)

// tokenReview asks the API server who a token belongs to. Only tokens bound
// to a pod are accepted: they name the pod, its UID and its node. Reviews
// have a budget of their own (--token-review-qps/--token-review-burst) and
// a client of their own, so that strangers with junk tokens can neither
// delay the agent's watches and patches nor wait in line before the real
// mTLS agent: beyond the budget a review is refused at once.
func reviewClient(c *ingest.Clients, cfg Config) (kubernetes.Interface, error) {
	restCfg := rest.CopyConfig(c.Config)
	restCfg.QPS, restCfg.Burst = float32(cfg.TokenReviewQPS), cfg.TokenReviewBurst
	kube, err := kubernetes.NewForConfig(restCfg)
	if err != nil {
		return nil, fmt.Errorf("TokenReview client: %w", err)
	}
	return kube, nil
}

// probeTokenReview asks the API server to review a token that is none:
// an answer, whatever it says, shows that reviews can be made (reachable,
// and permitted by RBAC).
func probeTokenReview(ctx context.Context, kube kubernetes.Interface) error {
	_, err := kube.AuthenticationV1().TokenReviews().Create(ctx, &authnv1.TokenReview{
		Spec: authnv1.TokenReviewSpec{Token: "mtlsbridge-readiness-probe"},
	}, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("TokenReview: %w", err)
	}
	return nil
}

// reviewer reviews tokens with kube within budget.
func reviewer(kube kubernetes.Interface, audiences []string, budget *reviewBudget) func(context.Context, string) (Caller, error) {
	return func(ctx context.Context, token string) (Caller, error) {
		if err := budget.allow(ctx); err != nil {
			return Caller{}, err
		}
		review, err := kube.AuthenticationV1().TokenReviews().Create(ctx, &authnv1.TokenReview{
			Spec: authnv1.TokenReviewSpec{Token: token, Audiences: audiences},
		}, metav1.CreateOptions{})
		if err != nil {
			return Caller{}, refusal(codes.Unavailable, "tokenreview-failed", "TokenReview failed: %v", err)
		}
		if !review.Status.Authenticated {
			return Caller{}, refusal(codes.Unauthenticated, "invalid-token", "token rejected by TokenReview: %s", review.Status.Error)
		}
		// An authenticator that ignores audiences (a webhook, legacy
		// tokens) says so by naming none of ours: such a token may be
		// meant for anyone, the pod's API token included.
		if !slices.ContainsFunc(review.Status.Audiences, func(a string) bool { return slices.Contains(audiences, a) }) {
			return Caller{}, refusal(codes.Unauthenticated, "wrong-audience", "token not valid for audiences %v (TokenReview says %v)", audiences, review.Status.Audiences)
		}
		parts := strings.Split(review.Status.User.Username, ":")
		if len(parts) != 4 || parts[0] != "system" || parts[1] != "serviceaccount" {
			return Caller{}, refusal(codes.PermissionDenied, "not-service-account", "token of %q is not a service account token", review.Status.User.Username)
		}
		caller := Caller{Namespace: parts[2], ServiceAccount: parts[3]}
		extra := func(key string) string {
			if v := review.Status.User.Extra[key]; len(v) == 1 {
				return v[0]
			}
			return ""
		}
		if caller.Pod = extra(extraPodName); caller.Pod == "" {
			return caller, refusal(codes.PermissionDenied, "unbound-token", "token of %s is not bound to a pod", review.Status.User.Username)
		}
		caller.PodUID, caller.Node = extra(extraPodUID), extra(extraNodeName)
		return caller, nil
	}
}

// refusalError is a gRPC status with the reason label it is counted under.
type refusalError struct {
	reason string
	status *status.Status
}

func (e *refusalError) Error() string              { return e.status.Message() }
func (e *refusalError) GRPCStatus() *status.Status { return e.status }

func refusal(code codes.Code, reason, format string, args ...any) error {
	return &refusalError{reason: reason, status: status.New(code, fmt.Sprintf(format, args...))}
}

// reviewProbeInterval is how often token reviews are probed: a readiness
// that names a forbidden or unreachable TokenReview API, before the mTLS
// agent finds out.
const reviewProbeInterval = 30 * time.Second

func registerReviewProbe(a *Authenticator, jobs job.Registry, health cell.Health, log *slog.Logger) {
	if a.probe == nil {
		return
	}
	notYet := errors.New("TokenReview not probed yet")
	a.probeErr.Store(&notYet)
	jobs.NewGroup(health).Add(job.OneShot("probe-token-review", func(ctx context.Context, health cell.Health) error {
		var last error = notYet
		for {
			probeCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
			err := a.probe(probeCtx)
			cancel()
			if ctx.Err() != nil {
				return nil
			}
			a.probeErr.Store(&err)
			switch {
			case err != nil:
				health.Degraded("token reviews fail", err)
				if last == nil || last == notYet {
					log.Error("Token reviews fail: the mTLS agent cannot authenticate", "error", err)
				}
			case last != nil:
				health.OK("token reviews work")
				if last != notYet {
					log.Info("Token reviews work again")
				}
			}
			last = err
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(reviewProbeInterval):
			}
		}
	}))
}

func readinessCheck(a *Authenticator, p authParams) api.CheckOut {
	if p.Mode != ingest.Kubernetes && p.Config.TokenFile == "" {
		return api.CheckOut{Check: api.Check{Name: "token-source", Warning: true, Err: func() error { return ErrNoTokenSource }}}
	}
	return api.CheckOut{Check: api.Check{Name: "token-review", Err: func() error {
		if a.probe == nil {
			return nil
		}
		return *a.probeErr.Load()
	}}}
}
