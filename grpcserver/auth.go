// SPDX-License-Identifier: Apache-2.0

package grpcserver

import (
	"bufio"
	"bytes"
	"context"
	"crypto/subtle"
	"fmt"
	"log/slog"
	"os"
	"strings"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	authnv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/mtlsbridge/mtlsbridge/reconcilers/enrollment"
	"github.com/mtlsbridge/mtlsbridge/tables"
	"github.com/mtlsbridge/mtlsbridge/tables/source"
)

// Caller is the pod a valid token belongs to.
type Caller struct {
	Namespace string
	Pod       string
	// ServiceAccount and Node are known from a TokenReview of a bound
	// token; empty from the token file.
	ServiceAccount string
	Node           string
}

// Key is "namespace/pod".
func (c Caller) Key() string { return c.Namespace + "/" + c.Pod }

// Authenticator decides who calls, and whether they may: only the mTLS
// agent pod of this node passes. Every refusal is logged and counted.
type Authenticator struct {
	log       *slog.Logger
	metrics   *Metrics
	localNode tables.LocalNode
	db        *statedb.DB
	pods      statedb.Table[*tables.Pod]
	verify    func(ctx context.Context, token string) (Caller, error)
}

type authParams struct {
	cell.In

	Config    Config
	Log       *slog.Logger
	Metrics   *Metrics
	LocalNode tables.LocalNode
	DB        *statedb.DB
	Pods      statedb.Table[*tables.Pod]
	Clients   *source.Clients
}

func newAuthenticator(p authParams) *Authenticator {
	a := &Authenticator{log: p.Log, metrics: p.Metrics, localNode: p.LocalNode, db: p.DB, pods: p.Pods}
	switch {
	case p.Clients != nil:
		a.verify = newReviewCache(tokenReview(p.Clients, p.Config.TokenAudiences)).verify
	case p.Config.TokenFile != "":
		a.verify = tokenFile(p.Config.TokenFile)
	default:
		a.verify = func(context.Context, string) (Caller, error) {
			return Caller{}, refusal(codes.Unauthenticated, "no-token-source", "no --token-file configured: no caller can authenticate")
		}
	}
	return a
}

// AuthenticateAgent returns the caller of a request when it presents a valid
// bearer token of this node's mTLS agent pod. It fails with Unauthenticated
// (no or bad token) or PermissionDenied (a valid token of another pod).
func (a *Authenticator) AuthenticateAgent(ctx context.Context) (Caller, error) {
	caller, err := a.authenticate(ctx)
	if err != nil {
		reason := "error"
		if r, ok := err.(*refusalError); ok {
			reason = r.reason
		}
		a.metrics.AuthRefused.WithLabelValues(reason).Inc()
		a.log.Warn("Refused gRPC caller", "reason", reason, "caller", caller.Key(), "error", err)
		return caller, err
	}
	return caller, nil
}

func (a *Authenticator) authenticate(ctx context.Context) (Caller, error) {
	token, err := bearerToken(ctx)
	if err != nil {
		return Caller{}, err
	}
	caller, err := a.verify(ctx, token)
	if err != nil {
		return caller, err
	}
	pod, _, found := a.pods.Get(a.db.ReadTxn(), tables.PodByKey(caller.Key()))
	switch {
	case !found:
		return caller, refusal(codes.PermissionDenied, "unknown-pod", "pod %s is not known", caller.Key())
	case pod.Labels.Get(enrollment.RedirTypeLabel) != enrollment.RedirTypeProxy:
		return caller, refusal(codes.PermissionDenied, "not-mtls-agent", "pod %s is not an mTLS agent (label %s=%s)",
			caller.Key(), enrollment.RedirTypeLabel, enrollment.RedirTypeProxy)
	case pod.NodeName != a.localNode.NodeName:
		return caller, refusal(codes.PermissionDenied, "other-node", "pod %s runs on node %q, not on this node %q",
			caller.Key(), pod.NodeName, a.localNode.NodeName)
	case caller.Node != "" && caller.Node != a.localNode.NodeName:
		return caller, refusal(codes.PermissionDenied, "other-node", "token of pod %s is bound to node %q, not %q",
			caller.Key(), caller.Node, a.localNode.NodeName)
	case caller.ServiceAccount != "" && caller.ServiceAccount != pod.ServiceAccountOrDefault():
		return caller, refusal(codes.PermissionDenied, "service-account-mismatch", "token of service account %q, pod %s runs as %q",
			caller.ServiceAccount, caller.Key(), pod.ServiceAccountOrDefault())
	}
	return caller, nil
}

func bearerToken(ctx context.Context) (string, error) {
	md, _ := metadata.FromIncomingContext(ctx)
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
	extraNodeName = "authentication.kubernetes.io/node-name"
)

// tokenReview asks the API server who a token belongs to. Only tokens bound
// to a pod are accepted: they name the pod and its node.
func tokenReview(c *source.Clients, audiences []string) func(context.Context, string) (Caller, error) {
	return func(ctx context.Context, token string) (Caller, error) {
		review, err := c.Kube.AuthenticationV1().TokenReviews().Create(ctx, &authnv1.TokenReview{
			Spec: authnv1.TokenReviewSpec{Token: token, Audiences: audiences},
		}, metav1.CreateOptions{})
		if err != nil {
			return Caller{}, refusal(codes.Unavailable, "tokenreview-failed", "TokenReview failed: %v", err)
		}
		if !review.Status.Authenticated {
			return Caller{}, refusal(codes.Unauthenticated, "invalid-token", "token rejected by TokenReview: %s", review.Status.Error)
		}
		parts := strings.Split(review.Status.User.Username, ":")
		if len(parts) != 4 || parts[0] != "system" || parts[1] != "serviceaccount" {
			return Caller{}, refusal(codes.PermissionDenied, "not-service-account", "token of %q is not a service account token", review.Status.User.Username)
		}
		caller := Caller{Namespace: parts[2], ServiceAccount: parts[3]}
		if v := review.Status.User.Extra[extraPodName]; len(v) == 1 {
			caller.Pod = v[0]
		} else {
			return caller, refusal(codes.PermissionDenied, "unbound-token", "token of %s is not bound to a pod", review.Status.User.Username)
		}
		if v := review.Status.User.Extra[extraNodeName]; len(v) == 1 {
			caller.Node = v[0]
		}
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
