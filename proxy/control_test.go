// SPDX-License-Identifier: Apache-2.0

package proxy_test

import (
	"context"
	"crypto/x509"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/mtlsbridge/mtlsbridge/internal/agenttest"
	"github.com/mtlsbridge/mtlsbridge/proxy"
	"github.com/mtlsbridge/mtlsbridge/xds"
)

const (
	webID = "spiffe://cluster.local/ns/app/sa/web"
	apiID = "spiffe://cluster.local/ns/app/sa/api"
	dbID  = "spiffe://cluster.local/ns/app/sa/db"
)

// agent is a real node agent for node-a (manifest folder, CA, xDS over
// TLS on loopback), with its xds-clients table at hand.
type agent struct {
	*agenttest.Agent
	streams statedb.Table[*xds.Client]
}

func startAgent(t *testing.T) *agent {
	t.Helper()
	manifests := t.TempDir()
	b, err := os.ReadFile("testdata/cluster.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(manifests, "cluster.yaml"), b, 0o644); err != nil {
		t.Fatal(err)
	}
	a := &agent{}
	a.Agent = agenttest.Start(t, manifests, []cell.Cell{
		cell.Invoke(func(s statedb.Table[*xds.Client]) { a.streams = s }),
	}, "--xds-coalesce=1ms")
	return a
}

// config is ztunnel-a's configuration against the agent at address
// (the agent's own, or a relay in front of it).
func (a *agent) config(t *testing.T, address string) proxy.Config {
	t.Helper()
	dir := t.TempDir()
	root := filepath.Join(dir, "root-cert.pem")
	token := filepath.Join(dir, "istio-token")
	must(t, os.WriteFile(root, a.RootPEM(t), 0o644))
	must(t, os.WriteFile(token, []byte("tok-a\n"), 0o600))
	env := map[string]string{
		proxy.EnvXDSAddress: "https://" + address, proxy.EnvXDSRootCA: root, proxy.EnvCARootCA: root,
		proxy.EnvAuthToken: token, proxy.EnvPodName: "ztunnel-a", proxy.EnvPodNamespace: "kube-system",
		proxy.EnvNodeName: "node-a", proxy.EnvInstanceIP: "10.0.1.2",
	}
	cfg, err := proxy.ConfigFromEnv(func(k string) string { return env[k] }, nil)
	must(t, err)
	return cfg
}

// testLogger logs into the test log until the test ends.
func testLogger(t *testing.T) *slog.Logger {
	w := &testWriter{t: t}
	t.Cleanup(func() { w.mu.Lock(); w.done = true; w.mu.Unlock() })
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// testWriter sends log lines to the test log while the test runs.
type testWriter struct {
	t    *testing.T
	mu   sync.Mutex
	done bool
}

func (w *testWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.done {
		w.t.Logf("%s", p)
	}
	return len(p), nil
}

// TestXDS: the client subscribes like ztunnel (the agent records its node
// id and wildcard subscriptions of both types), holds every workload of
// the cluster with HBONE where the agent says so, follows changes, and
// after its connection is cut reconnects with the versions it holds: the
// agent sends nothing it already has, and removes what went meanwhile.
func TestXDS(t *testing.T) {
	a := startAgent(t)
	relay := newCutter(t, a.GRPCAddr)
	cfg := a.config(t, relay.addr())
	metrics := proxy.NewMetrics(promRegistry())
	state := proxy.NewState(cfg.NodeName)
	x := proxy.NewXDS(cfg, state, metrics, testLogger(t))
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	go x.Run(ctx)
	waitClosed(t, x.Synced(), "xDS synced")

	web := state.ByIP(netip.MustParseAddr("10.0.1.10"))
	api := state.ByIP(netip.MustParseAddr("10.0.2.10"))
	if web == nil || api == nil || state.ByIP(netip.MustParseAddr("10.0.1.11")) != nil {
		t.Fatalf("workloads by address: web %v, api %v (plain must be absent)", web, api)
	}
	if web.Identity != webID || web.Node != "node-a" || web.HBONE || !web.HasAddress(netip.MustParseAddr("fd00:1::10")) {
		t.Errorf("web: %+v", web)
	}
	if api.Identity != apiID || api.Node != "node-b" || !api.HBONE {
		t.Errorf("api: %+v", api)
	}
	if state.ByUID("Kubernetes//Pod/app/web") != web {
		t.Error("web not found by uid")
	}
	if got := state.LocalIdentities(); len(got) != 1 || !got[webID] {
		t.Errorf("local identities %v, want only web's", got)
	}
	row := a.onlyStream(t)
	if row.Pod != "kube-system/ztunnel-a" || row.NodeID != "ztunnel~10.0.1.2~ztunnel-a.kube-system~kube-system.svc.cluster.local" ||
		row.Subscriptions[proxy.AddressType] != "*" || row.Subscriptions[proxy.AuthorizationType] != "*" {
		t.Errorf("agent sees the stream as %+v", row)
	}

	// A new pod reaches the state.
	a.WriteManifest(t, "db.yaml", dbPod)
	eventually(t, func() bool { return state.ByIP(netip.MustParseAddr("10.0.1.12")) != nil }, "db added")

	// Cut: while the client is away, api goes. On reconnection the agent
	// sends nothing but that removal.
	relay.cut()
	b, err := os.ReadFile("testdata/cluster.yaml")
	must(t, err)
	a.WriteManifest(t, "cluster.yaml", string(removeDoc(b, "name: api,")))
	eventually(t, func() bool { return testutil.ToFloat64(metrics.XDSConnects) >= 2 }, "reconnected")
	eventually(t, func() bool { return state.ByIP(netip.MustParseAddr("10.0.2.10")) == nil }, "api removed after reconnection")
	if state.ByIP(netip.MustParseAddr("10.0.1.10")) == nil || state.ByIP(netip.MustParseAddr("10.0.1.12")) == nil {
		t.Error("reconnection lost workloads the client held")
	}
	eventually(t, func() bool { r := a.onlyStream(t); return r.LastAckNonce != "" }, "second stream acked")
	if r := a.onlyStream(t); r.ResourcesSent != 1 {
		t.Errorf("after reconnection the agent sent %d resources, want only api's removal (the client held the rest)", r.ResourcesSent)
	}
	if n := testutil.ToFloat64(metrics.XDSNACKs.WithLabelValues("Address")); n != 0 {
		t.Errorf("%v NACKs", n)
	}
}

const dbPod = `apiVersion: v1
kind: Pod
metadata: {name: db, namespace: app}
spec: {nodeName: node-a, serviceAccountName: db}
status: {phase: Running, podIPs: [{ip: 10.0.1.12}]}
`

// TestCertificates: one certificate per local identity, asked with
// ImpersonatedIdentity and verified (SAN, chain to the agent's root);
// none for other nodes' workloads; renewed at half life; dropped when no
// local workload holds the identity; the bundle verifies peers of the CA.
func TestCertificates(t *testing.T) {
	a := startAgent(t)
	cfg := a.config(t, a.GRPCAddr)
	var now atomic.Int64
	now.Store(time.Now().UnixNano())
	cfg.Now = func() time.Time { return time.Unix(0, now.Load()) }
	metrics := proxy.NewMetrics(promRegistry())
	state := proxy.NewState(cfg.NodeName)
	x := proxy.NewXDS(cfg, state, metrics, testLogger(t))
	certs := proxy.NewCertificates(cfg, state, metrics, testLogger(t))
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	go x.Run(ctx)
	go certs.Run(ctx)

	eventually(t, func() bool { return certs.Get(webID) != nil }, "web's certificate")
	if certs.Get(apiID) != nil {
		t.Error("holds a certificate of api, a workload of another node")
	}
	leaf := certs.Get(webID).Leaf
	if len(leaf.URIs) != 1 || leaf.URIs[0].String() != webID {
		t.Errorf("leaf SANs %v", leaf.URIs)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(a.RootPEM(t))
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: pool, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
		t.Errorf("leaf does not chain to the agent's root: %v", err)
	}
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: certs.Bundle(), KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err != nil {
		t.Errorf("leaf does not verify against the proxy's bundle: %v", err)
	}
	if !certs.HoldsAll() {
		t.Error("HoldsAll false with web's certificate held")
	}

	// A new local workload: not all held until its certificate comes.
	a.WriteManifest(t, "db.yaml", dbPod)
	eventually(t, func() bool { return certs.Get(dbID) != nil && certs.HoldsAll() }, "db's certificate")

	// Half life passes: renewed, with a new key.
	serial := leaf.SerialNumber
	now.Store(leaf.NotBefore.Add(leaf.NotAfter.Sub(leaf.NotBefore)/2 + time.Second).UnixNano())
	eventually(t, func() bool { return certs.Get(webID).Leaf.SerialNumber.Cmp(serial) != 0 }, "web's certificate renewed")
	// Back to the present: the new certificates are fresh, no more renewals.
	now.Store(time.Now().UnixNano())
	time.Sleep(1500 * time.Millisecond)
	issued := testutil.ToFloat64(metrics.CertRequests.WithLabelValues("issued"))
	time.Sleep(1500 * time.Millisecond)
	if again := testutil.ToFloat64(metrics.CertRequests.WithLabelValues("issued")); again != issued || issued < 3 {
		t.Errorf("%v then %v certificates issued, want a stable count of at least 3 (web, db, web renewed)", issued, again)
	}

	// db goes: its certificate is dropped.
	must(t, os.Remove(filepath.Join(a.Manifests, "db.yaml")))
	eventually(t, func() bool { return certs.Get(dbID) == nil }, "db's certificate dropped")
	if certs.Get(webID) == nil {
		t.Error("web's certificate dropped with db's")
	}
}

// TestReadiness: /healthz/ready answers 503 naming what is missing until
// xDS synced and every local workload's certificate is held, then 200.
func TestReadiness(t *testing.T) {
	a := startAgent(t)
	cfg := a.config(t, a.GRPCAddr)
	cfg.Capture = false
	// Loopback listeners on free ports: this test needs no namespace.
	cfg.OutboundListen = []string{"127.0.0.1:0"}
	cfg.HBONEListen = []string{"127.0.0.1:0"}
	cfg.ReadinessListen, cfg.MetricsListen, cfg.AdminListen = "127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0"
	// The CA is unreachable at first: no certificate, not ready.
	blocked := newCutter(t, a.GRPCAddr)
	blocked.cut()
	blocked.refuse(true)
	cfg.CAAddress = blocked.addr()
	p := proxy.New(cfg, testLogger(t))
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()

	eventually(t, func() bool {
		code, body := get(p.ReadyHandler(), proxy.ReadyPath)
		return code == http.StatusServiceUnavailable && strings.Contains(body, "no certificate for "+webID)
	}, "not ready without web's certificate")
	select {
	case <-p.Ready():
		t.Fatal("ready without certificates")
	case <-time.After(200 * time.Millisecond):
	}
	blocked.refuse(false)
	waitClosed(t, p.Ready(), "ready once the CA answers")
	if code, _ := get(p.ReadyHandler(), proxy.ReadyPath); code != http.StatusOK {
		t.Errorf("ready endpoint answers %d", code)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

func get(h http.Handler, path string) (int, string) {
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
	return rec.Code, rec.Body.String()
}

// cutter is a TCP relay in front of the agent that the test can cut, and
// make refuse new connections.
type cutter struct {
	t        *testing.T
	l        net.Listener
	target   string
	mu       sync.Mutex
	conns    []net.Conn
	refusing bool
}

func newCutter(t *testing.T, target string) *cutter {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	must(t, err)
	c := &cutter{t: t, l: l, target: target}
	t.Cleanup(func() { l.Close(); c.cut() })
	go func() {
		for {
			in, err := l.Accept()
			if err != nil {
				return
			}
			c.mu.Lock()
			refusing := c.refusing
			c.mu.Unlock()
			if refusing {
				in.Close()
				continue
			}
			out, err := net.DialTimeout("tcp", target, 5*time.Second)
			if err != nil {
				in.Close()
				continue
			}
			c.mu.Lock()
			c.conns = append(c.conns, in, out)
			c.mu.Unlock()
			go func() { io.Copy(out, in); out.Close() }()
			go func() { io.Copy(in, out); in.Close() }()
		}
	}()
	return c
}

// addr is where clients connect: the agent's certificate names 127.0.0.1.
func (c *cutter) addr() string {
	return fmt.Sprintf("127.0.0.1:%d", c.l.Addr().(*net.TCPAddr).Port)
}

func (c *cutter) cut() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, conn := range c.conns {
		conn.Close()
	}
	c.conns = nil
}

func (c *cutter) refuse(on bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.refusing = on
}

// onlyStream is the agent's single xds-clients row.
func (a *agent) onlyStream(t *testing.T) *xds.Client {
	t.Helper()
	var rows []*xds.Client
	for r := range a.streams.All(a.DB.ReadTxn()) {
		rows = append(rows, r)
	}
	if len(rows) != 1 {
		// The old stream's row may linger a moment after a cut.
		eventually(t, func() bool { return a.streams.NumObjects(a.DB.ReadTxn()) == 1 }, "one xDS stream")
		rows = nil
		for r := range a.streams.All(a.DB.ReadTxn()) {
			rows = append(rows, r)
		}
	}
	return rows[0]
}

// removeDoc drops the YAML document containing marker.
func removeDoc(b []byte, marker string) []byte {
	docs := strings.Split(string(b), "\n---\n")
	docs = slices.DeleteFunc(docs, func(d string) bool { return strings.Contains(d, marker) })
	return []byte(strings.Join(docs, "\n---\n"))
}

func promRegistry() *prometheus.Registry { return prometheus.NewRegistry() }

func waitClosed(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(15 * time.Second):
		t.Fatalf("%s: not within 15s", what)
	}
}

// eventually polls cond (bounded: 15 s).
func eventually(t *testing.T, cond func() bool, what string) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 15s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
