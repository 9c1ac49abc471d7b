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
	"k8s.io/client-go/kubernetes"
)

// upstream is the signer a node agent forwards certificate requests to
// (--ca-upstream): the node holds no CA key, so root on a node obtains the
// identities of its own node's pods and no others.
type upstream struct {
	client pb.IstioCertificateServiceClient
	conn   *grpc.ClientConn
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
	// passthrough: the dialer, not gRPC's DNS resolver, finds the signer.
	conn, err := grpc.NewClient("passthrough:///"+cfg.CAUpstream, grpc.WithTransportCredentials(credentials.NewTLS(tlsConfig)),
		grpc.WithContextDialer(serviceDialer(kube)))
	if err != nil {
		return nil, fmt.Errorf("--ca-upstream=%q: %w", cfg.CAUpstream, err)
	}
	return &upstream{client: pb.NewIstioCertificateServiceClient(conn), conn: conn, tokenFile: cfg.CAUpstreamTokenFile, rootsFile: cfg.CAUpstreamRoots}, nil
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

// serviceDialer dials a signer named as a Service, NAME.NAMESPACE.svc, at
// the ready addresses of its EndpointSlices, read from the API server:
// the node agent shares the host's network namespace and resolver
// (Cilium's pod), which knows no cluster names, and pod addresses reach
// the signer without a Service translation in the host namespace. Other
// names and addresses are dialed as they are.
func serviceDialer(kube kubernetes.Interface) func(ctx context.Context, addr string) (net.Conn, error) {
	return func(ctx context.Context, addr string) (net.Conn, error) {
		host, port, err := net.SplitHostPort(addr)
		if err != nil {
			return nil, err
		}
		var dialer net.Dialer
		name, isService := strings.CutSuffix(host, ".svc")
		name, namespace, qualified := strings.Cut(name, ".")
		if !isService || !qualified || kube == nil {
			return dialer.DialContext(ctx, "tcp", addr)
		}
		addrs, err := readyEndpoints(ctx, kube, namespace, name, port)
		if err != nil {
			return nil, err
		}
		// Nodes spread over the replicas.
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

// readyEndpoints lists the host:port of the Service's ready endpoints: the
// slice's port when it has one (the Service's target), else servicePort.
func readyEndpoints(ctx context.Context, kube kubernetes.Interface, namespace, name, servicePort string) ([]string, error) {
	list, err := kube.DiscoveryV1().EndpointSlices(namespace).List(ctx, metav1.ListOptions{LabelSelector: discoveryv1.LabelServiceName + "=" + name})
	if err != nil {
		return nil, fmt.Errorf("endpoints of Service %s/%s: %w", namespace, name, err)
	}
	var addrs []string
	for _, slice := range list.Items {
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
	if len(addrs) == 0 {
		return nil, fmt.Errorf("Service %s/%s has no ready endpoint", namespace, name)
	}
	return addrs, nil
}
