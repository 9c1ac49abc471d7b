// SPDX-License-Identifier: Apache-2.0

package agent_test

import (
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/hive/hivetest"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	pb "istio.io/api/security/v1alpha1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/mtlsbridge/mtlsbridge/agent"
	"github.com/mtlsbridge/mtlsbridge/identity"
	"github.com/mtlsbridge/mtlsbridge/internal/kubetest"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/enrollment"
)

// TestKubernetesSigner runs the CA key in the signer alone: node agents
// with --ca-upstream forward what their mTLS agent may ask, and the signer
// signs for each node agent only identities of its own node's enrolled
// pods. Root on node-a, holding node-a's token, gets node-a's identities
// and no others.
func TestKubernetesSigner(t *testing.T) {
	cfg := kubetest.Start(t)
	kubetest.ApplyCiliumCRDs(t, cfg)
	ctx := t.Context()
	kube := kubernetes.NewForConfigOrDie(cfg)

	rootPEM := createCASecret(t, kube)
	for _, node := range []string{"node-a", "node-b"} {
		_, err := kube.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: node}}, metav1.CreateOptions{})
		must(t, err)
	}
	createNamespace(t, kube, "app", map[string]string{"io.cilium/mtls-enabled": "true"})
	createServiceAccounts(t, kube, "kube-system/ztunnel", "kube-system/cilium", "app/web", "app/api", "app/job")
	ciliumA := createPodAs(t, kube, "kube-system", "cilium-a", "node-a", "cilium", nil, "10.0.1.2")
	ciliumB := createPodAs(t, kube, "kube-system", "cilium-b", "node-b", "cilium", nil, "10.0.2.2")
	ztunnelA := createPodAs(t, kube, "kube-system", "ztunnel-a", "node-a", "ztunnel", map[string]string{"cilium.io/redir-type": "proxy"}, "127.0.0.1")
	createPodAs(t, kube, "app", "web", "node-a", "web", nil, "10.0.1.10")
	createPodAs(t, kube, "app", "api", "node-b", "api", nil, "10.0.2.10")
	// A pod on no node yet holds no identity: the signer keeps no row of it.
	_, err := kube.CoreV1().Pods("app").Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "unscheduled"},
		Spec:       corev1.PodSpec{ServiceAccountName: "job", Containers: []corev1.Container{{Name: "main", Image: "registry.invalid/none"}}},
	}, metav1.CreateOptions{})
	must(t, err)
	// A pod just started: the CNI has given it an address that the API
	// does not show yet, and node-a's mTLS agent asks for its identity.
	kubetest.CreateRunningPod(t, kube, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "starting", Namespace: "app"},
		Spec:       corev1.PodSpec{NodeName: "node-a", ServiceAccountName: "job"},
	})
	// A static pod, as root on node-a may make one: the API server refuses
	// it a service account (and this test's has no admission to add one).
	kubetest.CreateRunningPod(t, kube, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "static-node-a", Namespace: "app", Annotations: map[string]string{"kubernetes.io/config.mirror": "x"}},
		Spec:       corev1.PodSpec{NodeName: "node-a"},
	}, "10.0.1.11")
	tokenFor := func(pod *corev1.Pod, audience string) string { return boundToken(t, kube, pod, audience) }
	const (
		webID    = "spiffe://cluster.local/ns/app/sa/web"
		jobID    = "spiffe://cluster.local/ns/app/sa/job"
		apiID    = "spiffe://cluster.local/ns/app/sa/api"
		audience = "mtlsbridge-signer"
	)

	// Every caller here comes from loopback: one review budget for all.
	signer := startHive(t, cfg, hivetest.Logger(t), agent.SignerCell, "--node-name=", "--token-audiences="+audience, "--token-review-burst=100")
	waitEnrolled(t, signer, "app/web")
	waitEnrolled(t, signer, "app/api")
	waitEnrolled(t, signer, "app/static-node-a")
	waitEnrollment(t, signer, "app/starting", "awaiting its address", func(e *enrollment.Enrollment) bool { return e.AwaitingIP })
	if e, _, found := signer.enrollments.Get(signer.db.ReadTxn(), enrollment.ByKey("app/unscheduled")); found {
		t.Errorf("the signer keeps a row of a pod on no node: %+v", e)
	}
	signerAddr := grpcAddr(t, signer)

	// node-a's agent: the roots of the trust domain and its own token.
	files := t.TempDir()
	rootsFile, tokenFile := filepath.Join(files, "roots.pem"), filepath.Join(files, "token")
	must(t, os.WriteFile(rootsFile, rootPEM, 0o600))
	must(t, os.WriteFile(tokenFile, []byte(tokenFor(ciliumA, audience)), 0o600))
	nodeA := startAgent(t, cfg, "--ca-upstream="+signerAddr, "--ca-upstream-roots="+rootsFile, "--ca-upstream-token-file="+tokenFile)
	waitEnrolled(t, nodeA, "app/web")

	// The node's own CA, loaded before its listener started, serves the
	// listener only: it is not the trust domain's root.
	servingRoot, err := os.ReadFile(filepath.Join(nodeA.stateDir, "serving-ca", identity.CACertFile))
	must(t, err)
	if string(servingRoot) == string(rootPEM) {
		t.Fatal("node-a holds the trust domain's root")
	}

	viaNode := caClient(t, nodeA, "")
	resp, err := requestCert(t, viaNode, tokenFor(ztunnelA, "istio-ca"), webID)
	if err != nil {
		t.Fatalf("node-a's mTLS agent asking for web through node-a: %v", err)
	}
	leafVerifies(t, resp, rootPEM, webID)
	if resp, err := requestCert(t, viaNode, tokenFor(ztunnelA, "istio-ca"), jobID); err != nil {
		t.Errorf("node-a's mTLS agent asking for a pod awaiting its address in the API: %v", err)
	} else {
		leafVerifies(t, resp, rootPEM, jobID)
	}
	if _, err := requestCert(t, viaNode, tokenFor(ztunnelA, "istio-ca"), apiID); status.Code(err) != codes.PermissionDenied {
		t.Errorf("node-a's mTLS agent asking for api (node-b): %v, want PermissionDenied", err)
	}

	// What root on a node can do with its node agent's token: ask the
	// signer directly.
	direct := grpcClient(t, signerAddr, rootPEM)
	nodeBToken := tokenFor(ciliumB, audience) // one review, then cached
	if resp, err := requestCert(t, direct, nodeBToken, apiID); err != nil {
		t.Errorf("node-b's agent asking for api (node-b): %v", err)
	} else {
		leafVerifies(t, resp, rootPEM, apiID)
	}
	nodeAToken := tokenFor(ciliumA, audience) // one review, then cached
	for name, tc := range map[string]struct {
		token, id, reason string
		code              codes.Code
	}{
		"node-a's agent for node-b's identity":                 {nodeAToken, apiID, identity.ReasonNotOnThisNode, codes.PermissionDenied},
		"node-b's agent for node-a's pod awaiting its address": {nodeBToken, jobID, identity.ReasonNotOnThisNode, codes.PermissionDenied},
		"an mTLS agent, not a node agent":                      {tokenFor(ztunnelA, audience), webID, "not a node agent's", codes.PermissionDenied},
		"node-a's token for the node's CA":                     {tokenFor(ciliumA, "istio-ca"), webID, audience, codes.Unauthenticated},
		// Cilium identities are what nodes write in CiliumEndpoints.
		"node-a's agent for a Cilium identity": {nodeAToken, "spiffe://cluster.local/identity/4242", identity.ReasonIdentityScheme, codes.PermissionDenied},
		"node-a's agent for its static pod":    {nodeAToken, "spiffe://cluster.local/ns/app/sa/default", identity.ReasonNoServiceAccount, codes.PermissionDenied},
	} {
		_, err := withinReviewBudget(func() (*pb.IstioCertificateResponse, error) { return requestCert(t, direct, tc.token, tc.id) })
		if status.Code(err) != tc.code || !strings.Contains(err.Error(), tc.reason) {
			t.Errorf("%s: got %v, want %s (%s)", name, err, tc.code, tc.reason)
		}
	}

	// A signer that refuses is an error the mTLS agent sees, not a
	// certificate of the node's own CA.
	must(t, os.WriteFile(tokenFile, []byte(tokenFor(ztunnelA, audience)), 0o600))
	_, err = withinReviewBudget(func() (*pb.IstioCertificateResponse, error) {
		return requestCert(t, viaNode, tokenFor(ztunnelA, "istio-ca"), webID)
	})
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), identity.ReasonUpstreamRefused) || !strings.Contains(err.Error(), "not a node agent's") {
		t.Errorf("node-a forwarding with a token the signer refuses: %v, want Unavailable naming the refusal", err)
	}
}

// withinReviewBudget retries a request refused for the token reviews of
// its peer: every caller of the signer here shares loopback's budget (5 at
// once, 2 a second), which the test's callers spend in bursts.
func withinReviewBudget(request func() (*pb.IstioCertificateResponse, error)) (*pb.IstioCertificateResponse, error) {
	resp, err := request()
	for i := 0; i < 20 && strings.Contains(fmt.Sprint(err), "too many token reviews"); i++ {
		time.Sleep(250 * time.Millisecond)
		resp, err = request()
	}
	return resp, err
}

// leafVerifies checks that a CA answer's leaf is id's and chains to root.
func leafVerifies(t *testing.T, resp *pb.IstioCertificateResponse, rootPEM []byte, id string) {
	t.Helper()
	block, _ := pem.Decode([]byte(resp.CertChain[0]))
	leaf, err := x509.ParseCertificate(block.Bytes)
	must(t, err)
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(rootPEM)
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: pool, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil || leaf.URIs[0].String() != id {
		t.Fatalf("leaf %v does not verify as %s against the trust domain's root: %v", leaf.URIs, id, err)
	}
	if last := resp.CertChain[len(resp.CertChain)-1]; !strings.Contains(last, strings.TrimSpace(string(rootPEM))) {
		t.Errorf("the chain's roots do not hold the trust domain's root")
	}
}
