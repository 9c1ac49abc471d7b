// SPDX-License-Identifier: Apache-2.0

package identity_test

import (
	"bytes"
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"
	pb "istio.io/api/security/v1alpha1"

	"istio.io/istio/pkg/security"
	"istio.io/istio/security/pkg/nodeagent/caclient/providers/citadel"
	pkiutil "istio.io/istio/security/pkg/pki/util"

	"github.com/mtlsbridge/mtlsbridge/identity"
	"github.com/mtlsbridge/mtlsbridge/internal/agenttest"
)

// testAgent is a running agent on node-a with the CA, reached over gRPC+TLS.
type testAgent struct {
	*agenttest.Agent
	client pb.IstioCertificateServiceClient
	certs  statedb.Table[*identity.Certificate]
}

func startAgent(t *testing.T, extraFlags ...string) *testAgent {
	ta := &testAgent{}
	ta.Agent = agenttest.Start(t, "testdata", []cell.Cell{
		cell.Invoke(func(c statedb.Table[*identity.Certificate]) { ta.certs = c }),
	}, extraFlags...)
	ta.client = pb.NewIstioCertificateServiceClient(ta.Dial(t))
	return ta
}

func (ta *testAgent) rootPEM(t *testing.T) []byte { return ta.RootPEM(t) }

func (ta *testAgent) request(token string, req *pb.IstioCertificateRequest) (*pb.IstioCertificateResponse, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if token != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token)
	}
	return ta.client.CreateCertificate(ctx, req)
}

func newCSR(t testing.TB, key crypto.Signer, uris ...string) string {
	tmpl := &x509.CertificateRequest{}
	for _, u := range uris {
		parsed, err := url.Parse(u)
		if err != nil {
			t.Fatal(err)
		}
		tmpl.URIs = append(tmpl.URIs, parsed)
	}
	der, err := x509.CreateCertificateRequest(rand.Reader, tmpl, key)
	if err != nil {
		t.Fatal(err)
	}
	return string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der}))
}

func p256(t testing.TB) crypto.Signer {
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func parseChain(t *testing.T, chain []string) (*x509.Certificate, []*x509.Certificate) {
	var certs []*x509.Certificate
	for _, p := range chain {
		block, _ := pem.Decode([]byte(p))
		if block == nil {
			t.Fatalf("chain element is not PEM: %q", p)
		}
		c, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			t.Fatal(err)
		}
		certs = append(certs, c)
	}
	if len(certs) < 2 {
		t.Fatalf("chain of %d certificates, want leaf and root", len(certs))
	}
	return certs[0], certs[1:]
}

func verify(leaf *x509.Certificate, rootsPEM []byte) error {
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(rootsPEM)
	_, err := leaf.Verify(x509.VerifyOptions{Roots: pool, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}})
	return err
}

const webID = "spiffe://cluster.local/ns/app/sa/web"

func TestCAIssuesOnlyWhatItCanProve(t *testing.T) {
	ta := startAgent(t)
	key := p256(t)

	// Valid requests: both identity schemes of web, an enrolled pod on this
	// node, asked by this node's agent; with and without impersonation.
	for _, tc := range []struct {
		id       string
		validity int64
		meta     *structpb.Struct
		wantTTL  time.Duration
	}{
		{id: webID, validity: 3600, wantTTL: time.Hour},
		{id: "spiffe://cluster.local/identity/4242", validity: 0, wantTTL: 24 * time.Hour},
		{id: webID, validity: 7 * 86400, wantTTL: 24 * time.Hour, // capped at --ca-max-cert-ttl
			meta: &structpb.Struct{Fields: map[string]*structpb.Value{"ImpersonatedIdentity": structpb.NewStringValue(webID)}}},
	} {
		resp, err := ta.request("tok-a", &pb.IstioCertificateRequest{Csr: newCSR(t, key, tc.id), ValidityDuration: tc.validity, Metadata: tc.meta})
		if err != nil {
			t.Fatalf("%s: %v", tc.id, err)
		}
		leaf, roots := parseChain(t, resp.CertChain)
		if len(leaf.URIs) != 1 || leaf.URIs[0].String() != tc.id || len(leaf.DNSNames)+len(leaf.IPAddresses) != 0 {
			t.Errorf("%s: leaf SANs %v %v %v, want exactly the URI", tc.id, leaf.URIs, leaf.DNSNames, leaf.IPAddresses)
		}
		if !leaf.PublicKey.(*ecdsa.PublicKey).Equal(key.Public()) {
			t.Errorf("%s: leaf is not for the CSR's key", tc.id)
		}
		if err := verify(leaf, ta.rootPEM(t)); err != nil {
			t.Errorf("%s: leaf does not verify against root-cert.pem: %v", tc.id, err)
		}
		if !roots[len(roots)-1].IsCA || !bytes.Equal(roots[0].Raw, mustRoot(t, ta.rootPEM(t)).Raw) {
			t.Errorf("%s: chain does not end with the root", tc.id)
		}
		if got := leaf.NotAfter.Sub(leaf.NotBefore) - time.Minute; got < tc.wantTTL-time.Minute || got > tc.wantTTL+time.Minute {
			t.Errorf("%s: validity %s, want about %s", tc.id, got, tc.wantTTL)
		}
		if _, _, found := ta.certs.Get(ta.DB.ReadTxn(), identity.CertificateBySerial(leaf.SerialNumber.Text(16))); !found {
			t.Errorf("%s: serial %x not in the certificates table", tc.id, leaf.SerialNumber)
		}
	}
	if got := testutil.ToFloat64(ta.counter(t, "mtlsbridge_ca_certificates_issued_total", "")); got != 3 {
		t.Errorf("issued counter = %v, want 3", got)
	}

	rsa1024, err := rsa.GenerateKey(rand.Reader, 1024)
	if err != nil {
		t.Fatal(err)
	}
	badSignature := func() string {
		block, _ := pem.Decode([]byte(newCSR(t, key, webID)))
		block.Bytes[len(block.Bytes)-3] ^= 0xff // inside the signature
		return string(pem.EncodeToMemory(block))
	}()
	// Refusals, each with its code and reason.
	for _, tc := range []struct {
		name, token, csr string
		meta             *structpb.Struct
		code             codes.Code
		reason           string
	}{
		{"no token", "", newCSR(t, key, webID), nil, codes.Unauthenticated, "no authorization metadata"},
		{"unknown token", "tok-nobody", newCSR(t, key, webID), nil, codes.Unauthenticated, "token not in --token-file"},
		{"token of a workload pod", "tok-web", newCSR(t, key, webID), nil, codes.PermissionDenied, "is not an mTLS agent"},
		{"token of the other node's agent", "tok-b", newCSR(t, key, webID), nil, codes.PermissionDenied, "runs on node \"node-b\""},
		{"identity of a pod on another node", "tok-a", newCSR(t, key, "spiffe://cluster.local/ns/app/sa/api"), nil, codes.PermissionDenied, identity.ReasonNotOnThisNode},
		{"identity of a non-enrolled pod", "tok-a", newCSR(t, key, "spiffe://cluster.local/ns/app/sa/plain"), nil, codes.PermissionDenied, identity.ReasonNotEnrolled},
		{"two SANs", "tok-a", newCSR(t, key, webID, "spiffe://cluster.local/identity/4242"), nil, codes.PermissionDenied, identity.ReasonSANs},
		{"wrong trust domain", "tok-a", newCSR(t, key, "spiffe://evil.example/ns/app/sa/web"), nil, codes.PermissionDenied, identity.ReasonTrustDomain},
		{"reserved identity (host)", "tok-a", newCSR(t, key, "spiffe://cluster.local/identity/1"), nil, codes.PermissionDenied, identity.ReasonReservedIdentity},
		{"signature does not verify", "tok-a", badSignature, nil, codes.PermissionDenied, identity.ReasonBadSignature},
		{"weak key", "tok-a", newCSR(t, rsa1024, webID), nil, codes.PermissionDenied, identity.ReasonWeakKey},
		{"metadata disagrees with SAN", "tok-a", newCSR(t, key, webID),
			&structpb.Struct{Fields: map[string]*structpb.Value{"ImpersonatedIdentity": structpb.NewStringValue("spiffe://cluster.local/ns/app/sa/api")}},
			codes.PermissionDenied, identity.ReasonImpersonationMismatch},
		{"not a CSR", "tok-a", "hello", nil, codes.InvalidArgument, identity.ReasonMalformedCSR},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ta.request(tc.token, &pb.IstioCertificateRequest{Csr: tc.csr, Metadata: tc.meta})
			st := status.Convert(err)
			if err == nil || st.Code() != tc.code || !strings.Contains(st.Message(), tc.reason) {
				t.Fatalf("got %v, want %s containing %q", err, tc.code, tc.reason)
			}
		})
	}
	for _, reason := range []string{identity.ReasonNotOnThisNode, identity.ReasonNotEnrolled, identity.ReasonSANs,
		identity.ReasonTrustDomain, identity.ReasonReservedIdentity, identity.ReasonBadSignature, identity.ReasonWeakKey, identity.ReasonImpersonationMismatch} {
		if got := testutil.ToFloat64(ta.counter(t, "mtlsbridge_ca_requests_refused_total", reason)); got != 1 {
			t.Errorf("refused{reason=%q} = %v, want 1", reason, got)
		}
	}
	// Callers that are not this node's agent are refused by the listener,
	// from their headers, before the CA sees the request.
	for reason, want := range map[string]float64{"no-token": 1, "invalid-token": 1, "not-mtls-agent": 1, "other-node": 1} {
		if got := testutil.ToFloat64(ta.counter(t, "mtlsbridge_grpc_auth_refused_total", reason)); got != want {
			t.Errorf("grpc auth refused{reason=%q} = %v, want %v", reason, got, want)
		}
	}
	if n := ta.certs.NumObjects(ta.DB.ReadTxn()); n != 3 {
		t.Errorf("%d certificates listed, want the 3 issued", n)
	}

	// The CA's private key appears nowhere: not in logs, tables or the bundle.
	var dump bytes.Buffer
	ta.DB.ReadTxn().WriteJSON(&dump)
	caKey, err := os.ReadFile(filepath.Join(ta.StateDir, "ca", identity.CAKeyFile))
	if err != nil {
		t.Fatal(err)
	}
	keyBody := strings.Split(string(caKey), "\n")[1]
	for what, text := range map[string]string{"logs": ta.Logs.String(), "table dump": dump.String(), "bundle": string(ta.rootPEM(t))} {
		if strings.Contains(text, "PRIVATE KEY") || strings.Contains(text, keyBody) {
			t.Errorf("the %s contain private key material", what)
		}
	}
	if info, err := os.Stat(filepath.Join(ta.StateDir, "ca", identity.CAKeyFile)); err != nil || info.Mode().Perm() != 0o600 {
		t.Errorf("CA key file mode %v (%v), want 0600", info.Mode().Perm(), err)
	}
}

func mustRoot(t *testing.T, bundle []byte) *x509.Certificate {
	block, _ := pem.Decode(bundle)
	c, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func (ta *testAgent) counter(t *testing.T, name, reason string) prometheus.Collector {
	families, err := ta.Metrics.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			if reason == "" || (len(m.GetLabel()) == 1 && m.GetLabel()[0].GetValue() == reason) {
				return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "x"}, func() float64 { return m.GetCounter().GetValue() })
			}
		}
	}
	return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "x"}, func() float64 { return 0 })
}

// The certificates table keeps the newest few certificates of an identity:
// an agent asking in a loop does not grow it until they expire.
// The mTLS agent's label counts only in --mtls-agent-namespaces: any pod
// owner can set it, and the agent may have any workload's identity of its
// node. Here the node's agent runs in kube-system, not trusted.
func TestAgentOnlyInItsNamespaces(t *testing.T) {
	ta := startAgent(t, "--mtls-agent-namespaces=mtls-agents")
	_, err := ta.request("tok-a", &pb.IstioCertificateRequest{Csr: newCSR(t, p256(t), webID)})
	if st := status.Convert(err); st.Code() != codes.PermissionDenied || !strings.Contains(st.Message(), "is not an mTLS agent") {
		t.Fatalf("agent label in an untrusted namespace: %v, want PermissionDenied", err)
	}
}

func TestCertificatesTableIsBounded(t *testing.T) {
	ta := startAgent(t)
	var serials []string
	for range 10 {
		resp, err := ta.request("tok-a", &pb.IstioCertificateRequest{Csr: newCSR(t, p256(t), webID)})
		if err != nil {
			t.Fatal(err)
		}
		leaf, _ := parseChain(t, resp.GetCertChain())
		serials = append(serials, fmt.Sprintf("%x", leaf.SerialNumber))
	}
	txn := ta.DB.ReadTxn()
	if n := ta.certs.NumObjects(txn); n != 4 {
		t.Errorf("%d certificates listed after 10 of one identity, want the last 4", n)
	}
	if _, _, ok := ta.certs.Get(txn, identity.CertificateBySerial(serials[9])); !ok {
		t.Error("the newest certificate is not listed")
	}
}

// A restart reuses the CA generated on the first start.
func TestCAMaterialReusedAcrossRestarts(t *testing.T) {
	ta := startAgent(t)
	first := ta.rootPEM(t)
	dir := filepath.Join(ta.StateDir, "ca")
	m, err := identity.LoadDir(dir, "cluster.local", true)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(m.BundlePEM(), first) {
		t.Fatal("a second load generated new material instead of reusing it")
	}
}

// A rotation introduces a new root while the old one stays trusted;
// certificates of both verify against the bundle during the overlap, and
// only the new root's after retirement.
func TestCARotation(t *testing.T) {
	ta := startAgent(t, "--ca-reload-interval=50ms")
	key := p256(t)
	issue := func() *x509.Certificate {
		resp, err := ta.request("tok-a", &pb.IstioCertificateRequest{Csr: newCSR(t, key, webID)})
		if err != nil {
			t.Fatal(err)
		}
		leaf, _ := parseChain(t, resp.CertChain)
		return leaf
	}
	dir := filepath.Join(ta.StateDir, "ca")
	oldLeaf := issue()
	oldBundle := ta.rootPEM(t)

	rotate := func(want identity.RotationStep) {
		t.Helper()
		if step, err := identity.RotateDir(dir, "cluster.local"); err != nil || step != want {
			t.Fatalf("RotateDir: step %d, %v; want step %d", step, err, want)
		}
	}
	// Step 1: the agent picks the new root up by itself; the bundle grows
	// to two roots, and the old root still signs, so that a peer holding
	// only the old bundle still verifies what the agent issues.
	rotate(identity.RootTrusted)
	waitFor(t, func() bool { return bytes.Count(ta.rootPEM(t), []byte("BEGIN CERTIFICATE")) == 2 })
	overlap := ta.rootPEM(t)
	if err := verify(issue(), oldBundle); err != nil {
		t.Fatalf("a leaf issued once the new root is trusted does not verify against the old bundle: %v", err)
	}
	if err := identity.RetireDir(dir); !errors.Is(err, identity.ErrRotationHalfway) {
		t.Fatalf("retiring half-way: %v, want %v", err, identity.ErrRotationHalfway)
	}
	// Step 2: the new root signs; the bundle is the same two roots.
	rotate(identity.RootSigning)
	var newLeaf *x509.Certificate
	waitFor(t, func() bool { newLeaf = issue(); return verify(newLeaf, oldBundle) != nil })
	if got := ta.rootPEM(t); bytes.Count(got, []byte("BEGIN CERTIFICATE")) != 2 {
		t.Fatalf("bundle after step 2:\n%s\nwant the two roots", got)
	}
	for name, leaf := range map[string]*x509.Certificate{"old": oldLeaf, "new": newLeaf} {
		if err := verify(leaf, overlap); err != nil {
			t.Errorf("during the overlap the %s leaf does not verify against the bundle: %v", name, err)
		}
	}
	// Istio's own client, as istio-agent uses it, during the overlap: the
	// last element of the chain is its trust anchor, and must hold both
	// roots (with one root per element, it held only the old one and the
	// new leaf failed: "certificate signed by unknown authority").
	chain := citadelSign(t, ta, key)
	if len(chain) != 2 {
		t.Fatalf("chain of %d elements, want [leaf, roots]", len(chain))
	}
	anchor := []byte(chain[len(chain)-1])
	if n := bytes.Count(anchor, []byte("BEGIN CERTIFICATE")); n != 2 {
		t.Errorf("the last element holds %d roots during the overlap, want both", n)
	}
	keyPEM, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	privPEM := pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyPEM})
	// What istio-agent checks of a workload certificate.
	workloadFields := &pkiutil.VerifyFields{
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		KeyUsage:    x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		Host:        webID,
	}
	if err := pkiutil.VerifyCertificate(privPEM, []byte(chain[0]), anchor, workloadFields); err != nil {
		t.Errorf("Istio's VerifyCertificate on the new leaf and the chain's anchor: %v", err)
	}
	oldLeafPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: oldLeaf.Raw})
	if err := pkiutil.VerifyCertificate(privPEM, oldLeafPEM, anchor, workloadFields); err != nil {
		t.Errorf("Istio's VerifyCertificate on the old leaf and the chain's anchor: %v", err)
	}

	if err := identity.RetireDir(dir); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { return bytes.Count(ta.rootPEM(t), []byte("BEGIN CERTIFICATE")) == 1 })
	if err := verify(oldLeaf, ta.rootPEM(t)); err == nil {
		t.Error("after retirement the old leaf still verifies")
	}
	if err := verify(issue(), ta.rootPEM(t)); err != nil {
		t.Errorf("after retirement a new leaf does not verify: %v", err)
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not met in 10s")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// citadelSign asks for a certificate with Istio's CitadelClient, the CA
// client istio-agent uses, trusting the agent's bundle.
func citadelSign(t *testing.T, ta *testAgent, key crypto.Signer) []string {
	t.Helper()
	rootFile := filepath.Join(t.TempDir(), "root-cert.pem")
	if err := os.WriteFile(rootFile, ta.rootPEM(t), 0o600); err != nil {
		t.Fatal(err)
	}
	client, err := citadel.NewCitadelClient(&security.Options{
		CAEndpoint:  ta.GRPCAddr,
		ClusterID:   "Kubernetes",
		CredFetcher: staticToken("tok-a"),
	}, &citadel.TLSOptions{RootCert: rootFile})
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	chain, err := client.CSRSign([]byte(newCSR(t, key, webID)), 3600)
	if err != nil {
		t.Fatalf("CitadelClient.CSRSign: %v", err)
	}
	return chain
}

// staticToken is a security.CredFetcher of one token.
type staticToken string

func (s staticToken) GetPlatformCredential() (string, error) { return string(s), nil }
func (staticToken) GetIdentityProvider() string              { return "" }
func (staticToken) Stop()                                    {}

// TestBundleWriteRetried: a trust bundle that cannot be written when the
// material changes (here a folder in its place) is written at a later
// reload, not only at the next change of the material.
func TestBundleWriteRetried(t *testing.T) {
	ta := startAgent(t, "--ca-reload-interval=50ms")
	bundle := filepath.Join(ta.StateDir, "ca", identity.RootCertFile)
	if err := errors.Join(os.Remove(bundle), os.Mkdir(bundle, 0o700)); err != nil {
		t.Fatal(err)
	}
	if _, err := identity.RotateDir(filepath.Join(ta.StateDir, "ca"), "cluster.local"); err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond) // a few reloads fail to write
	if err := os.Remove(bundle); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool {
		b, err := os.ReadFile(bundle)
		return err == nil && bytes.Count(b, []byte("BEGIN CERTIFICATE")) == 2
	})
}

// TestRotationResumes: a rotation's second step interrupted after the next
// key became the signing key, or before the next files went, is completed
// by running it again: the next root signs, the old one stays trusted.
func TestRotationResumes(t *testing.T) {
	for _, stop := range []string{"after the bundle", "after the key", "before the cleanup"} {
		t.Run(stop, func(t *testing.T) {
			dir := t.TempDir()
			if _, err := identity.LoadDir(dir, "cluster.local", true); err != nil {
				t.Fatal(err)
			}
			old, err := os.ReadFile(filepath.Join(dir, identity.CACertFile))
			if err != nil {
				t.Fatal(err)
			}
			if step, err := identity.RotateDir(dir, "cluster.local"); err != nil || step != identity.RootTrusted {
				t.Fatalf("step 1: %d, %v", step, err)
			}
			nextCert, err1 := os.ReadFile(filepath.Join(dir, identity.NextCACertFile))
			nextKey, err2 := os.ReadFile(filepath.Join(dir, identity.NextCAKeyFile))
			if err := errors.Join(err1, err2); err != nil {
				t.Fatal(err)
			}
			// What step 2 writes before it is interrupted, taken from a
			// copy of the folder that completes it.
			completed := t.TempDir()
			if err := os.CopyFS(completed, os.DirFS(dir)); err != nil {
				t.Fatal(err)
			}
			if step, err := identity.RotateDir(completed, "cluster.local"); err != nil || step != identity.RootSigning {
				t.Fatalf("step 2: %d, %v", step, err)
			}
			trusted, err := os.ReadFile(filepath.Join(completed, identity.TrustedRootsFile))
			if err != nil {
				t.Fatal(err)
			}
			files := map[string][]byte{identity.TrustedRootsFile: trusted}
			if stop != "after the bundle" {
				files[identity.CAKeyFile] = nextKey
			}
			if stop == "before the cleanup" {
				files[identity.CACertFile] = nextCert
			}
			for name, content := range files {
				if err := os.WriteFile(filepath.Join(dir, name), content, 0o600); err != nil {
					t.Fatal(err)
				}
			}
			if step, err := identity.RotateDir(dir, "cluster.local"); err != nil || step != identity.RootSigning {
				t.Fatalf("resumed: %d, %v; want step 2 completed", step, err)
			}
			m, err := identity.LoadDir(dir, "cluster.local", false)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(m.Root.Raw, mustRoot(t, nextCert).Raw) || len(m.Trusted) != 1 || !bytes.Equal(m.Trusted[0].Raw, mustRoot(t, old).Raw) {
				t.Errorf("signing %s, trusting %d roots; want the next root signing and the old one trusted", m.Root.Subject.CommonName, len(m.Trusted))
			}
			for _, f := range []string{identity.NextCACertFile, identity.NextCAKeyFile} {
				if _, err := os.Stat(filepath.Join(dir, f)); !errors.Is(err, os.ErrNotExist) {
					t.Errorf("%s left behind: %v", f, err)
				}
			}
		})
	}
}
