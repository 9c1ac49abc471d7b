// SPDX-License-Identifier: Apache-2.0

package identity

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	pb "istio.io/api/security/v1alpha1"

	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/mtlsbridge/mtlsbridge/internal/kubetest"
)

// A signer named as a Service is found at its ready endpoints, as the API
// server shows them to a watch: those of every slice of the Service, none
// of another Service's, none not ready, and changes as they come. (The API server refuses loopback addresses in
// a slice, so these are names, which are never dialed here.)
func TestReadyEndpoints(t *testing.T) {
	srv := kubetest.StartServer(t, kubetest.Options{})
	kube := kubernetes.NewForConfigOrDie(srv.Config)
	ready, notReady := true, false
	slice := func(name, service string, ports []discoveryv1.EndpointPort, endpoints ...discoveryv1.Endpoint) {
		_, err := kube.DiscoveryV1().EndpointSlices("kube-system").Create(t.Context(), &discoveryv1.EndpointSlice{
			ObjectMeta:  metav1.ObjectMeta{Name: name, Labels: map[string]string{discoveryv1.LabelServiceName: service}},
			AddressType: discoveryv1.AddressTypeFQDN,
			Endpoints:   endpoints,
			Ports:       ports,
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
	}
	slice("signer-1", "mtlsbridge-signer", []discoveryv1.EndpointPort{{Name: new("grpc"), Port: new(int32(16012))}},
		discoveryv1.Endpoint{Addresses: []string{"signer-0.example"}, Conditions: discoveryv1.EndpointConditions{Ready: &ready}},
		discoveryv1.Endpoint{Addresses: []string{"terminating.example"}, Conditions: discoveryv1.EndpointConditions{Ready: &notReady}})
	slice("signer-2", "mtlsbridge-signer", nil,
		discoveryv1.Endpoint{Addresses: []string{"signer-1.example"}})
	slice("other-1", "mtlsbridge-signer-old", nil,
		discoveryv1.Endpoint{Addresses: []string{"other.example"}, Conditions: discoveryv1.EndpointConditions{Ready: &ready}})

	follow := func(host string) *signerEndpoints {
		e, err := newSignerEndpoints(kube, host)
		if err != nil {
			t.Fatal(err)
		}
		go e.informer.RunWithContext(t.Context())
		return e
	}
	signer := follow("mtlsbridge-signer.kube-system.svc")
	endpoints := func(e *signerEndpoints) ([]string, error) {
		ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
		defer cancel()
		got, err := e.ready(ctx, "15012")
		slices.Sort(got)
		return got, err
	}
	// A slice's own port is the Service's target port.
	if got, err := endpoints(signer); err != nil || !slices.Equal(got, []string{"signer-0.example:16012", "signer-1.example:15012"}) {
		t.Errorf("ready endpoints %v (%v)", got, err)
	}
	if _, err := endpoints(follow("none.kube-system.svc")); err == nil || !strings.Contains(err.Error(), "no ready endpoint") {
		t.Errorf("a Service without endpoints: %v", err)
	}
	// Followed: a replica that goes and one that comes are seen.
	if err := kube.DiscoveryV1().EndpointSlices("kube-system").Delete(t.Context(), "signer-2", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	slice("signer-3", "mtlsbridge-signer", nil, discoveryv1.Endpoint{Addresses: []string{"signer-2.example"}})
	deadline := time.Now().Add(10 * time.Second)
	for got, _ := endpoints(signer); !slices.Equal(got, []string{"signer-0.example:16012", "signer-2.example:15012"}); got, _ = endpoints(signer) {
		if time.Now().After(deadline) {
			t.Fatalf("ready endpoints %v after the changes", got)
		}
		time.Sleep(20 * time.Millisecond)
	}
	// Not listed at each dial: with the API server gone, a dial still
	// finds them, in memory.
	srv.Kill()
	if got, err := endpoints(signer); err != nil || !slices.Equal(got, []string{"signer-0.example:16012", "signer-2.example:15012"}) {
		t.Errorf("ready endpoints with the API server gone: %v (%v), want those followed", got, err)
	}
	if e, err := newSignerEndpoints(kube, "signer.example:15012"); e != nil || err != nil {
		t.Errorf("a name that is no Service's is followed: %v, %v", e, err)
	}
}

// testSigner is a signer on loopback over TLS whose answers the test
// chooses, serving with a certificate of ca.
type testSigner struct {
	pb.UnimplementedIstioCertificateServiceServer
	answer func(ctx context.Context, req *pb.IstioCertificateRequest) (*pb.IstioCertificateResponse, error)
}

func (s *testSigner) CreateCertificate(ctx context.Context, req *pb.IstioCertificateRequest) (*pb.IstioCertificateResponse, error) {
	return s.answer(ctx, req)
}

// newTestAuthority is an Authority of a new root, and the root (PEM).
func newTestAuthority(tb testing.TB) (*Authority, []byte) {
	certPEM, keyPEM, err := NewRootMaterial("cluster.local", time.Hour)
	if err != nil {
		tb.Fatal(err)
	}
	m, err := ParseMaterial(certPEM, keyPEM, nil)
	if err != nil {
		tb.Fatal(err)
	}
	a := &Authority{}
	a.Set(m, nil)
	return a, certPEM
}

// newCSR is a CSR (PEM, and parsed) for san with a new P-256 key.
func newCSR(tb testing.TB, san string) (string, *x509.CertificateRequest) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		tb.Fatal(err)
	}
	u, _ := url.Parse(san)
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{URIs: []*url.URL{u}}, key)
	if err != nil {
		tb.Fatal(err)
	}
	csr, err := x509.ParseCertificateRequest(der)
	if err != nil {
		tb.Fatal(err)
	}
	return string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der})), csr
}

func serveTestSigner(t *testing.T, serving *Authority, s *testSigner) string {
	return serveTestSignerOn(t, serving, s, "127.0.0.1:0")
}

// serveTestSignerOn is serveTestSigner on a loopback address chosen.
func serveTestSignerOn(t *testing.T, serving *Authority, s *testSigner, addr string) string {
	cert, err := serving.ServingCertificate([]string{"127.0.0.1"})
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(grpc.Creds(credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{*cert}})))
	pb.RegisterIstioCertificateServiceServer(srv, s)
	l, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(l)
	t.Cleanup(srv.Stop)
	return l.Addr().String()
}

// newTestUpstream is a node agent's forwarding to the signer at addr, with
// the roots rootPEM and the token "node-token" (its file ends in a newline,
// as a kubelet's may).
func newTestUpstream(t *testing.T, addr string, rootPEM []byte) *upstream {
	t.Helper()
	files := t.TempDir()
	rootsFile, tokenFile := filepath.Join(files, "roots.pem"), filepath.Join(files, "token")
	for file, content := range map[string][]byte{rootsFile: rootPEM, tokenFile: []byte("node-token\n")} {
		if err := os.WriteFile(file, content, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	up, err := newUpstream(Config{CAUpstream: addr, CAUpstreamRoots: rootsFile, CAUpstreamTokenFile: tokenFile}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { up.conn.Close() })
	return up
}

// signedBy is a signer's answer: by's certificate for c's key and san.
func signedBy(by *Authority, c *x509.CertificateRequest, san string) (*pb.IstioCertificateResponse, error) {
	issued, err := by.SignWorkload(c, san, time.Hour)
	if err != nil {
		return nil, err
	}
	return &pb.IstioCertificateResponse{CertChain: issued.ChainPEM}, nil
}

// A node agent takes from the signer only the certificate it asked for:
// the identity, the key, through the roots it trusts, from a signer
// whose certificate chains to them. Each failure is counted by what it
// was.
func TestUpstreamChecksTheAnswer(t *testing.T) {
	const id, other = "spiffe://cluster.local/ns/app/sa/web", "spiffe://cluster.local/ns/app/sa/api"
	ca, rootPEM := newTestAuthority(t)
	stranger, _ := newTestAuthority(t)
	csrPEM, csr := newCSR(t, id)
	_, otherCSR := newCSR(t, id)

	for name, tc := range map[string]struct {
		serving *Authority
		answer  func() (*pb.IstioCertificateResponse, error)
		reason  string
	}{
		"the certificate asked for": {ca, func() (*pb.IstioCertificateResponse, error) { return signedBy(ca, csr, id) }, ""},
		"another identity":          {ca, func() (*pb.IstioCertificateResponse, error) { return signedBy(ca, csr, other) }, ReasonUpstreamBadAnswer},
		"another key":               {ca, func() (*pb.IstioCertificateResponse, error) { return signedBy(ca, otherCSR, id) }, ReasonUpstreamBadAnswer},
		"another CA's leaf":         {ca, func() (*pb.IstioCertificateResponse, error) { return signedBy(stranger, csr, id) }, ReasonUpstreamBadAnswer},
		"a leaf without roots": {ca, func() (*pb.IstioCertificateResponse, error) {
			r, err := signedBy(ca, csr, id)
			r.CertChain = r.CertChain[:1]
			return r, err
		}, ReasonUpstreamBadAnswer},
		"a refusal":   {ca, func() (*pb.IstioCertificateResponse, error) { return nil, status.Error(codes.PermissionDenied, "no") }, ReasonUpstreamRefused},
		"unavailable": {ca, func() (*pb.IstioCertificateResponse, error) { return nil, status.Error(codes.Unavailable, "busy") }, ReasonUpstreamUnreachable},
		"a signer serving with another CA's certificate": {stranger, func() (*pb.IstioCertificateResponse, error) { return signedBy(stranger, csr, id) }, ReasonUpstreamUnreachable},
	} {
		t.Run(name, func(t *testing.T) {
			var got *pb.IstioCertificateRequest
			var token []string
			addr := serveTestSigner(t, tc.serving, &testSigner{answer: func(ctx context.Context, req *pb.IstioCertificateRequest) (*pb.IstioCertificateResponse, error) {
				got = req
				md, _ := metadata.FromIncomingContext(ctx)
				token = md.Get("authorization")
				return tc.answer()
			}})
			up := newTestUpstream(t, addr, rootPEM)
			issued, err := up.sign(t.Context(), csrPEM, csr, id, 2*time.Hour)
			var upErr *upstreamError
			switch {
			case tc.reason == "" && (err != nil || issued.Leaf.URIs[0].String() != id):
				t.Fatalf("sign: %v", err)
			case tc.reason != "" && (!errors.As(err, &upErr) || upErr.reason != tc.reason):
				t.Fatalf("sign: %v, want %s", err, tc.reason)
			case tc.reason != "" && !errors.Is(up.lastErr(), err):
				t.Errorf("the readiness warning says %v, want %v", up.lastErr(), err)
			}
			if tc.serving != ca {
				return // refused at the handshake: nothing was asked
			}
			if got == nil || got.Csr != csrPEM || got.ValidityDuration != 7200 ||
				got.Metadata.GetFields()["ImpersonatedIdentity"].GetStringValue() != id || !slices.Equal(token, []string{"Bearer node-token"}) {
				t.Errorf("the signer was asked %+v with %v", got, token)
			}
		})
	}
}

// A signer that was unreachable is used again by the next request once it
// is back, not when gRPC's reconnection backoff says (a second after the
// first failure, growing to two minutes in a long outage): a failed
// request makes the connection try again at once.
func TestUpstreamReconnectsAtOnce(t *testing.T) {
	const id = "spiffe://cluster.local/ns/app/sa/web"
	ca, rootPEM := newTestAuthority(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close() // nothing listens there: the signer is gone
	up := newTestUpstream(t, addr, rootPEM)
	csrPEM, csr := newCSR(t, id)
	sign := func() error {
		_, err := up.sign(t.Context(), csrPEM, csr, id, time.Hour)
		return err
	}
	var upErr *upstreamError
	if err := sign(); !errors.As(err, &upErr) || upErr.reason != ReasonUpstreamUnreachable {
		t.Fatalf("a request while the signer is gone: %v, want %s", err, ReasonUpstreamUnreachable)
	}
	failed := time.Now()
	serveTestSignerOn(t, ca, &testSigner{answer: func(context.Context, *pb.IstioCertificateRequest) (*pb.IstioCertificateResponse, error) {
		return signedBy(ca, csr, id)
	}}, addr)
	// Requests may still fail while a reconnection that began before the
	// signer was back fails; each failure makes it try again. Without
	// that, gRPC's first backoff (0.8 s at least) would let none succeed
	// within 700 ms of the first failure.
	for err = sign(); err != nil && time.Since(failed) < 700*time.Millisecond; err = sign() {
		time.Sleep(50 * time.Millisecond)
	}
	if err != nil {
		t.Fatalf("%v after the first failure, the signer back: %v", time.Since(failed).Round(time.Millisecond), err)
	}
}
