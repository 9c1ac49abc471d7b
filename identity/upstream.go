// SPDX-License-Identifier: Apache-2.0

package identity

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"
	pb "istio.io/api/security/v1alpha1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
)

// upstream is the signer a node agent forwards certificate requests to
// (--ca-upstream): the node holds no CA key, so root on a node obtains the
// identities of its own node's pods and no others.
type upstream struct {
	client pb.IstioCertificateServiceClient
	conn   *grpc.ClientConn
	// endpoints follows the signer's Service, when it is named as one.
	endpoints *signerEndpoints
	// tokenFile is re-read for every request: the kubelet renews it;
	// rootsFile too (a root rotation).
	tokenFile, rootsFile string
	// last is the outcome of the last request (nil: none yet, or success).
	last atomic.Pointer[error]
}

// lastErr is why the last forwarded request failed, if it did.
func (u *upstream) lastErr() error {
	if err := u.last.Load(); err != nil {
		return *err
	}
	return nil
}

// upstreamTimeout bounds one forwarded request.
const upstreamTimeout = 10 * time.Second

func newUpstream(cfg Config, kube kubernetes.Interface) (*upstream, error) {
	host, _, err := net.SplitHostPort(cfg.CAUpstream)
	if err != nil {
		return nil, fmt.Errorf("--ca-upstream=%q: %w", cfg.CAUpstream, err)
	}
	if cfg.CAUpstreamRoots == "" || cfg.CAUpstreamTokenFile == "" {
		return nil, errors.New("--ca-upstream needs --ca-upstream-roots and --ca-upstream-token-file")
	}
	// The roots are read at every handshake, so that a root rotation
	// (the file is a mounted ConfigMap) needs no restart.
	tlsConfig := &tls.Config{
		MinVersion:         tls.VersionTLS12,
		InsecureSkipVerify: true, // verified below, against the roots as they are now
		VerifyConnection: func(cs tls.ConnectionState) error {
			pool, err := readRoots(cfg.CAUpstreamRoots)
			if err != nil {
				return err
			}
			if len(cs.PeerCertificates) == 0 {
				return errors.New("the signer sent no certificate")
			}
			intermediates := x509.NewCertPool()
			for _, c := range cs.PeerCertificates[1:] {
				intermediates.AddCert(c)
			}
			_, err = cs.PeerCertificates[0].Verify(x509.VerifyOptions{DNSName: host, Roots: pool, Intermediates: intermediates})
			return err
		},
	}
	endpoints, err := newSignerEndpoints(kube, host)
	if err != nil {
		return nil, err
	}
	// passthrough: the dialer, not gRPC's DNS resolver, finds the signer.
	conn, err := grpc.NewClient("passthrough:///"+cfg.CAUpstream, grpc.WithTransportCredentials(credentials.NewTLS(tlsConfig)),
		grpc.WithContextDialer(endpoints.dialer()))
	if err != nil {
		return nil, fmt.Errorf("--ca-upstream=%q: %w", cfg.CAUpstream, err)
	}
	return &upstream{client: pb.NewIstioCertificateServiceClient(conn), conn: conn, endpoints: endpoints,
		tokenFile: cfg.CAUpstreamTokenFile, rootsFile: cfg.CAUpstreamRoots}, nil
}

// start follows the signer's endpoints until stop.
func (u *upstream) start(stop <-chan struct{}) {
	if u.endpoints != nil {
		go u.endpoints.informer.RunWithContext(wait.ContextForChannel(stop))
	}
}

// upstreamError is a forwarded request that failed, with the reason it is
// counted under: the signer refused it, could not be asked, or answered
// with something else than the certificate asked for.
type upstreamError struct {
	reason string
	err    error
}

func (e *upstreamError) Error() string { return e.err.Error() }
func (e *upstreamError) Unwrap() error { return e.err }

// Reasons a forwarded request fails, as counted in
// mtlsbridge_ca_requests_refused_total.
const (
	ReasonUpstreamRefused     = "upstream-refused"
	ReasonUpstreamUnreachable = "upstream-unreachable"
	ReasonUpstreamBadAnswer   = "upstream-bad-answer"
)

func badAnswer(format string, args ...any) error {
	return &upstreamError{ReasonUpstreamBadAnswer, fmt.Errorf("the signer's answer: "+format, args...)}
}

// sign asks the signer for a certificate of id for the CSR's key, as this
// node's agent, and checks the answer as an mTLS agent would and more: a
// leaf for that key, with id as its only SAN, verifying through the
// roots of --ca-upstream-roots, then the roots.
func (u *upstream) sign(ctx context.Context, csrPEM string, csr *x509.CertificateRequest, id string, ttl time.Duration) (*Issued, error) {
	issued, err := u.ask(ctx, csrPEM, csr, id, ttl)
	u.last.Store(&err)
	return issued, err
}

func (u *upstream) ask(ctx context.Context, csrPEM string, csr *x509.CertificateRequest, id string, ttl time.Duration) (*Issued, error) {
	token, err := os.ReadFile(u.tokenFile)
	if err != nil {
		return nil, &upstreamError{ReasonUpstreamUnreachable, fmt.Errorf("--ca-upstream-token-file: %w", err)}
	}
	ctx, cancel := context.WithTimeout(ctx, upstreamTimeout)
	defer cancel()
	ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+strings.TrimSpace(string(token)))
	resp, err := u.client.CreateCertificate(ctx, &pb.IstioCertificateRequest{
		Csr:              csrPEM,
		ValidityDuration: int64(ttl / time.Second),
		Metadata: &structpb.Struct{Fields: map[string]*structpb.Value{
			impersonatedIdentityKey: structpb.NewStringValue(id),
		}},
	})
	switch status.Code(err) {
	case codes.OK:
	case codes.PermissionDenied, codes.Unauthenticated, codes.InvalidArgument:
		return nil, &upstreamError{ReasonUpstreamRefused, err}
	default:
		// The next request reconnects at once, rather than when gRPC's
		// backoff (up to 2 minutes after a long outage) says: requests
		// pace the attempts, and a signer back is used at once.
		u.conn.ResetConnectBackoff()
		return nil, &upstreamError{ReasonUpstreamUnreachable, err}
	}
	chain := resp.GetCertChain()
	if len(chain) < 2 {
		return nil, badAnswer("%d chain elements, want the leaf and the roots", len(chain))
	}
	block, _ := pem.Decode([]byte(chain[0]))
	if block == nil {
		return nil, badAnswer("the leaf is not PEM")
	}
	leaf, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		return nil, badAnswer("the leaf: %v", err)
	}
	if len(leaf.URIs) != 1 || leaf.URIs[0].String() != id || len(leaf.DNSNames)+len(leaf.IPAddresses)+len(leaf.EmailAddresses) > 0 {
		return nil, badAnswer("the leaf names %v %v %v %v, want only %s", leaf.URIs, leaf.DNSNames, leaf.IPAddresses, leaf.EmailAddresses, id)
	}
	if !publicKeysEqual(leaf.PublicKey, csr.PublicKey) {
		return nil, badAnswer("the leaf is not for the requested key")
	}
	roots, err := readRoots(u.rootsFile)
	if err != nil {
		return nil, &upstreamError{ReasonUpstreamUnreachable, err}
	}
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: roots, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth, x509.ExtKeyUsageServerAuth}}); err != nil {
		return nil, badAnswer("the leaf does not verify through --ca-upstream-roots: %v", err)
	}
	return &Issued{Leaf: leaf, ChainPEM: chain}, nil
}

// readRoots reads --ca-upstream-roots.
func readRoots(path string) (*x509.CertPool, error) {
	pem, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("--ca-upstream-roots: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("--ca-upstream-roots %s: no PEM certificate", path)
	}
	return pool, nil
}

// signerEndpoints follows the ready endpoints of a signer named as a
// Service, NAME.NAMESPACE.svc: its EndpointSlices, watched (as kube-proxy
// and Cilium watch them), so that a dial reads them from memory. The node
// agent shares the host's network namespace and resolver (Cilium's pod),
// which knows no cluster names, and pod addresses reach the signer without
// a Service translation in the host namespace.
type signerEndpoints struct {
	namespace, name string
	informer        cache.SharedIndexInformer
	// listErr is the last error listing or watching the slices.
	listErr atomic.Pointer[error]
}

// newSignerEndpoints follows the Service named by host, or returns nil for
// another name or an address, which is dialed as it is.
func newSignerEndpoints(kube kubernetes.Interface, host string) (*signerEndpoints, error) {
	name, isService := strings.CutSuffix(host, ".svc")
	name, namespace, qualified := strings.Cut(name, ".")
	if !isService || !qualified || kube == nil {
		return nil, nil
	}
	slices := kube.DiscoveryV1().EndpointSlices(namespace)
	selector := discoveryv1.LabelServiceName + "=" + name
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, opts metav1.ListOptions) (runtime.Object, error) {
			opts.LabelSelector = selector
			return slices.List(ctx, opts)
		},
		WatchFuncWithContext: func(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error) {
			opts.LabelSelector = selector
			return slices.Watch(ctx, opts)
		},
	}
	e := &signerEndpoints{namespace: namespace, name: name,
		informer: cache.NewSharedIndexInformer(lw, &discoveryv1.EndpointSlice{}, 0, cache.Indexers{})}
	if err := e.informer.SetWatchErrorHandlerWithContext(func(_ context.Context, _ *cache.Reflector, err error) {
		e.listErr.Store(&err)
	}); err != nil {
		return nil, err
	}
	return e, nil
}

// ready lists the host:port of the Service's ready endpoints, waiting
// (within ctx) for the first listing unless it failed.
func (e *signerEndpoints) ready(ctx context.Context, servicePort string) ([]string, error) {
	for !e.informer.HasSynced() {
		if err := e.listErr.Load(); err != nil {
			return nil, fmt.Errorf("endpoints of Service %s/%s: %w", e.namespace, e.name, *err)
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("endpoints of Service %s/%s: not listed yet: %w", e.namespace, e.name, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
	var slices []*discoveryv1.EndpointSlice
	for _, o := range e.informer.GetStore().List() {
		slices = append(slices, o.(*discoveryv1.EndpointSlice))
	}
	addrs := readyAddrs(slices, servicePort)
	if len(addrs) == 0 {
		return nil, fmt.Errorf("Service %s/%s has no ready endpoint", e.namespace, e.name)
	}
	return addrs, nil
}

// dialer dials the signer: at one of the ready endpoints of its Service,
// when it is named as one (spreading nodes over the replicas), else at the
// address as it is.
func (e *signerEndpoints) dialer() func(ctx context.Context, addr string) (net.Conn, error) {
	return func(ctx context.Context, addr string) (net.Conn, error) {
		var dialer net.Dialer
		if e == nil {
			return dialer.DialContext(ctx, "tcp", addr)
		}
		_, port, err := net.SplitHostPort(addr)
		if err != nil {
			return nil, err
		}
		addrs, err := e.ready(ctx, port)
		if err != nil {
			return nil, err
		}
		rand.Shuffle(len(addrs), func(i, j int) { addrs[i], addrs[j] = addrs[j], addrs[i] })
		var errs []error
		for _, addr := range addrs {
			conn, err := dialer.DialContext(ctx, "tcp", addr)
			if err == nil {
				return conn, nil
			}
			errs = append(errs, err)
		}
		return nil, errors.Join(errs...)
	}
}

// readyAddrs lists the host:port of the slices' ready endpoints: the
// slice's port when it has one (the Service's target), else servicePort.
func readyAddrs(slices []*discoveryv1.EndpointSlice, servicePort string) []string {
	var addrs []string
	for _, slice := range slices {
		port := servicePort
		if len(slice.Ports) == 1 && slice.Ports[0].Port != nil {
			port = strconv.Itoa(int(*slice.Ports[0].Port))
		}
		for _, ep := range slice.Endpoints {
			// Unknown readiness counts as ready, as for kube-proxy.
			if ep.Conditions.Ready == nil || *ep.Conditions.Ready {
				for _, a := range ep.Addresses {
					addrs = append(addrs, net.JoinHostPort(a, port))
				}
			}
		}
	}
	return addrs
}
