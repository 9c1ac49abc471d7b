// SPDX-License-Identifier: Apache-2.0

package agent_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	pb "istio.io/api/security/v1alpha1"
	authnv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/mtlsbridge/mtlsbridge/api"
	"github.com/mtlsbridge/mtlsbridge/api/client"
	"github.com/mtlsbridge/mtlsbridge/identity"
	"github.com/mtlsbridge/mtlsbridge/internal/kubetest"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/enrollment"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// TestKubernetesCA runs the CA in Kubernetes mode: its material comes from
// a Secret, callers present projected service account tokens bound to their
// pod, and TokenReview decides who they are. Only this node's agent pod
// gets a certificate, and only for a pod of this node.
func TestKubernetesCA(t *testing.T) {
	cfg := kubetest.Start(t)
	kubetest.ApplyCiliumCRDs(t, cfg)
	ctx := t.Context()
	kube := kubernetes.NewForConfigOrDie(cfg)

	certPEM := createCASecret(t, kube)
	createNamespace(t, kube, "app", map[string]string{"io.cilium/mtls-enabled": "true"})
	createServiceAccounts(t, kube, "kube-system/ztunnel", "app/web")
	// This node's agent connects from its pod's address: loopback here.
	agentA := createPodAs(t, kube, "kube-system", "ztunnel-a", "node-a", "ztunnel", map[string]string{"cilium.io/redir-type": "proxy"}, "127.0.0.1")
	agentB := createPodAs(t, kube, "kube-system", "ztunnel-b", "node-b", "ztunnel", map[string]string{"cilium.io/redir-type": "proxy"}, "10.0.2.2")
	createPodAs(t, kube, "app", "web", "node-a", "web", nil, "10.0.1.10")

	a := startAgent(t, cfg)
	waitEnrolled(t, a, "app/web")
	client := caClient(t, a, "")

	tokenFor := func(pod *corev1.Pod, audience string) string { return boundToken(t, kube, pod, audience) }
	requestWith := func(client pb.IstioCertificateServiceClient, token, id string) (*pb.IstioCertificateResponse, error) {
		return requestCert(t, client, token, id)
	}
	request := func(token, id string) (*pb.IstioCertificateResponse, error) { return requestWith(client, token, id) }
	// retrying retries refused reviews (Unavailable), as ztunnel does: the
	// test spends more distinct tokens than an agent ever holds.
	retrying := func(token, id string) (*pb.IstioCertificateResponse, error) {
		for range 20 {
			resp, err := request(token, id)
			if status.Code(err) != codes.Unavailable {
				return resp, err
			}
			time.Sleep(250 * time.Millisecond)
		}
		return nil, fmt.Errorf("refused for 5 s")
	}

	const webID = "spiffe://cluster.local/ns/app/sa/web"
	resp, err := request(tokenFor(agentA, "istio-ca"), webID)
	if err != nil {
		t.Fatalf("this node's agent with a bound token: %v", err)
	}
	block, _ := pem.Decode([]byte(resp.CertChain[0]))
	leaf, err := x509.ParseCertificate(block.Bytes)
	must(t, err)
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(certPEM)
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: pool, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil || leaf.URIs[0].String() != webID {
		t.Fatalf("leaf %v does not verify against the Secret's root: %v", leaf.URIs, err)
	}

	for name, tc := range map[string]struct {
		token, id string
		code      codes.Code
	}{
		"the other node's agent":       {tokenFor(agentB, "istio-ca"), webID, codes.PermissionDenied},
		"a token for another audience": {tokenFor(agentA, "someone-else"), webID, codes.Unauthenticated},
		"a token that is not a token":  {"not-a-jwt", webID, codes.Unauthenticated},
	} {
		if _, err := request(tc.token, tc.id); status.Code(err) != tc.code {
			t.Errorf("%s: got %v, want %s", name, err, tc.code)
		}
	}

	// Strangers with junk tokens spend a TokenReview budget of their own,
	// not the agent's API client's (100 of them delayed the real
	// certificate by 16.8 s when reviews shared its 5 requests/s), and not
	// that of this node's mTLS agent, which is served at once.
	stranger := caClient(t, a, "127.0.0.2")
	var junk sync.WaitGroup
	refusedByBudget := atomic.Int32{}
	for i := range 100 {
		junk.Go(func() {
			_, err := requestWith(stranger, fmt.Sprintf("junk-%d", i), webID)
			if strings.Contains(err.Error(), "too many token reviews") {
				refusedByBudget.Add(1)
			}
		})
	}
	fresh := tokenFor(agentA, "istio-ca") // not cached: it needs a review of its own
	if _, err := request(fresh, webID); err != nil {
		t.Errorf("this node's agent during a junk-token flood: %v", err)
	}
	junk.Wait()
	if n := refusedByBudget.Load(); n < 90 {
		t.Errorf("%d of 100 junk tokens at once refused by the review budget, want nearly all", n)
	}

	// A token stays bound to the pod it was made for: once that pod is
	// deleted, a new pod of the same name does not inherit it, even while
	// the review of the token is cached.
	oldToken := tokenFor(agentA, "istio-ca")
	if _, err := retrying(oldToken, webID); err != nil {
		t.Fatalf("agent's token before its pod is replaced: %v", err)
	}
	must(t, kube.CoreV1().Pods("kube-system").Delete(ctx, agentA.Name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)}))
	replaced := createPodAs(t, kube, "kube-system", "ztunnel-a", "node-a", "ztunnel", map[string]string{"cilium.io/redir-type": "proxy"}, "127.0.0.1")
	waitPodUID(t, a, "kube-system/ztunnel-a", string(replaced.UID))
	if _, err := request(oldToken, webID); status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), "gone") {
		t.Errorf("the deleted pod's token for its namesake: %v, want PermissionDenied", err)
	}
	if _, err := retrying(tokenFor(replaced, "istio-ca"), webID); err != nil {
		t.Errorf("the new pod's own token: %v", err)
	}
}

// waitPodUID waits until the agent's pods table shows the pod with uid.
func waitPodUID(t *testing.T, a *k8sAgent, key, uid string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		if p, _, ok := a.pods.Get(a.db.ReadTxn(), tables.PodByKey(key)); ok && p.UID == uid {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("pod %s with uid %s not in the pods table in time", key, uid)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// createCASecret creates the CA Secret of Kubernetes mode
// (kube-system/mtlsbridge-ca) with a new root, and returns the root.
func createCASecret(t *testing.T, kube kubernetes.Interface) []byte {
	certPEM, keyPEM, err := identity.NewRootMaterial("cluster.local", time.Hour)
	must(t, err)
	_, err = kube.CoreV1().Secrets("kube-system").Create(t.Context(), &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "mtlsbridge-ca", Namespace: "kube-system"},
		Data:       map[string][]byte{identity.CACertFile: certPEM, identity.CAKeyFile: keyPEM},
	}, metav1.CreateOptions{})
	must(t, err)
	return certPEM
}

// createServiceAccounts creates the NAMESPACE/NAME accounts.
func createServiceAccounts(t *testing.T, kube kubernetes.Interface, accounts ...string) {
	for _, sa := range accounts {
		ns, name, _ := strings.Cut(sa, "/")
		_, err := kube.CoreV1().ServiceAccounts(ns).Create(t.Context(), &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
		must(t, err)
	}
}

// boundToken is a token of pod's service account for audience, bound to
// the pod (so naming its node), as a projected volume holds it.
func boundToken(t *testing.T, kube kubernetes.Interface, pod *corev1.Pod, audience string) string {
	tr, err := kube.CoreV1().ServiceAccounts(pod.Namespace).CreateToken(t.Context(), pod.Spec.ServiceAccountName, &authnv1.TokenRequest{
		Spec: authnv1.TokenRequestSpec{
			Audiences:      []string{audience},
			BoundObjectRef: &authnv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID},
		},
	}, metav1.CreateOptions{})
	must(t, err)
	return tr.Status.Token
}

func createPodAs(t *testing.T, kube kubernetes.Interface, ns, name, node, sa string, labels map[string]string, ip string) *corev1.Pod {
	return kubetest.CreateRunningPod(t, kube, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: labels},
		Spec:       corev1.PodSpec{NodeName: node, ServiceAccountName: sa},
	}, ip)
}

func waitEnrolled(t *testing.T, a *k8sAgent, key string) {
	t.Helper()
	waitEnrollment(t, a, key, "enrolled", func(e *enrollment.Enrollment) bool { return e.Enrolled })
}

// waitEnrollment waits until pod key's row is what ok says.
func waitEnrollment(t *testing.T, a *k8sAgent, key, what string, ok func(*enrollment.Enrollment) bool) {
	t.Helper()
	deadline := time.After(30 * time.Second)
	for {
		e, _, found := a.enrollments.Get(a.db.ReadTxn(), enrollment.ByKey(key))
		if found && ok(e) {
			return
		}
		_, watch := a.enrollments.AllWatch(a.db.ReadTxn())
		select {
		case <-watch:
		case <-deadline:
			t.Fatalf("%s not %s in time", key, what)
		}
	}
}

// requestCert asks client for a certificate of id, with a new key, as the
// bearer of token.
func requestCert(t *testing.T, client pb.IstioCertificateServiceClient, token, id string) (*pb.IstioCertificateResponse, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	must(t, err)
	u, _ := url.Parse(id)
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{URIs: []*url.URL{u}}, key)
	must(t, err)
	ctx := metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer "+token)
	return client.CreateCertificate(ctx, &pb.IstioCertificateRequest{
		Csr: string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der})),
	})
}

// grpcAddr is the address of the hive's gRPC listener.
func grpcAddr(t *testing.T, a *k8sAgent) string {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	addr, err := a.grpc.Addr(ctx)
	must(t, err)
	return addr.String()
}

// grpcClient dials addr trusting only rootPEM.
func grpcClient(t *testing.T, addr string, rootPEM []byte) pb.IstioCertificateServiceClient {
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(rootPEM)
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{RootCAs: pool})))
	must(t, err)
	t.Cleanup(func() { conn.Close() })
	return pb.NewIstioCertificateServiceClient(conn)
}

// caClient dials the agent's gRPC listener trusting only the bundle it
// wrote, from the loopback address from (any when empty).
func caClient(t *testing.T, a *k8sAgent, from string) pb.IstioCertificateServiceClient {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	addr := grpcAddr(t, a)
	var bundle []byte
	for bundle == nil {
		bundle, _ = os.ReadFile(filepath.Join(a.stateDir, "ca", identity.RootCertFile))
		if bundle == nil {
			select {
			case <-ctx.Done():
				t.Fatal("the agent wrote no root-cert.pem")
			case <-time.After(20 * time.Millisecond):
			}
		}
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(bundle)
	dialer := &net.Dialer{}
	if from != "" {
		dialer.LocalAddr = &net.TCPAddr{IP: net.ParseIP(from)}
	}
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{RootCAs: pool})),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) { return dialer.DialContext(ctx, "tcp", addr) }))
	must(t, err)
	t.Cleanup(func() { conn.Close() })
	return pb.NewIstioCertificateServiceClient(conn)
}

// Readiness covers what the node's service depends on: with the CA Secret
// missing (every TLS client would get "internal error"), /healthz names
// it and says not ready; once the Secret exists, the agent loads it and
// is ready.
func TestReadinessNamesMissingCA(t *testing.T) {
	cfg := kubetest.Start(t)
	kubetest.ApplyCiliumCRDs(t, cfg)
	kube := kubernetes.NewForConfigOrDie(cfg)
	a := startAgent(t, cfg, "--ca-reload-interval=100ms")
	health := func() api.Health {
		var h api.Health
		resp, err := client.New(a.stateDir).Do(t.Context(), http.MethodGet, "/healthz", "", nil)
		if err == nil {
			json.NewDecoder(resp.Body).Decode(&h)
			resp.Body.Close()
		}
		return h
	}
	waitHealth := func(what string, ok func(api.Health) bool) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for h := health(); !ok(h); h = health() {
			if time.Now().After(deadline) {
				t.Fatalf("%s: /healthz says %+v", what, h)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	waitHealth("the missing CA named", func(h api.Health) bool {
		return !h.Ready && len(h.Pending) == 0 && strings.Contains(h.Failing["ca-material"], "kube-system/mtlsbridge-ca")
	})
	if h := health(); h.Failing["token-review"] != "" {
		t.Errorf("token reviews fail with admin credentials: %v", h.Failing)
	}
	createCASecret(t, kube)
	waitHealth("ready once the Secret exists", func(h api.Health) bool { return h.Ready })
}
