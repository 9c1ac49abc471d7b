// SPDX-License-Identifier: Apache-2.0

package proxy

import (
	"bufio"
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"istio.io/istio/pkg/workloadapi/security"

	"github.com/mtlsbridge/mtlsbridge/identity"
	"github.com/mtlsbridge/mtlsbridge/internal/netnstest"
	"github.com/mtlsbridge/mtlsbridge/internal/syncbuf"
)

// Two proxies in one process, on loopback addresses standing for pods:
// web (node-a, 127.0.0.11) behind proxy a, api (node-b, 127.0.0.12) behind
// proxy b. Real TLS 1.3, real HTTP/2, certificates from a real CA
// (identity.Authority); only the capture is left out (TestCapture and the
// e2e tests cover it): the test hands a's outbound side a connection
// directly, and b listens for HBONE on api's address.
const (
	hbWebIP   = "127.0.0.11"
	hbAPIIP   = "127.0.0.12"
	hbOtherIP = "127.0.0.13"
	hbWebID   = "spiffe://cluster.local/ns/app/sa/web"
	hbAPIID   = "spiffe://cluster.local/ns/app/sa/api"
)

type hbonePair struct {
	t        *testing.T
	ca       *identity.Authority
	a, b     *Proxy
	web, api *Workload
	// app is api's application: "hello REMOTE\n", then an echo until EOF.
	app netip.AddrPort
	// appSaw receives the remote address of each connection app accepts.
	appSaw chan netip.AddrPort
	bLog   *syncbuf.Buffer
	aLog   *syncbuf.Buffer
	// stopB stops b's HBONE side as a stopping proxy does; bStopped is
	// closed once its accept loop and every connection it served ended.
	stopB    context.CancelFunc
	bStopped chan struct{}
}

func newHBONEPair(t *testing.T) *hbonePair {
	// Transparent sockets (the proxy's dials in a pod's name) need
	// CAP_NET_ADMIN even for loopback addresses.
	netnstest.RequirePrivileged(t)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	h := &hbonePair{t: t, ca: newAuthority(t), appSaw: make(chan netip.AddrPort, 16), aLog: &syncbuf.Buffer{}, bLog: &syncbuf.Buffer{}}
	h.web = &Workload{UID: "web", Name: "web", Namespace: "app", Node: "node-a", Identity: hbWebID,
		Addresses: []netip.Addr{netip.MustParseAddr(hbWebIP)}, HBONE: true}
	h.api = &Workload{UID: "api", Name: "api", Namespace: "app", Node: "node-b", Identity: hbAPIID,
		Addresses: []netip.Addr{netip.MustParseAddr(hbAPIIP)}, HBONE: true}
	h.a = h.newProxy("node-a", h.aLog)
	h.b = h.newProxy("node-b", h.bLog)
	h.give(h.a, h.ca, hbWebID)
	h.give(h.b, h.ca, hbAPIID)

	// b's HBONE listener, on api's address.
	l, err := net.Listen("tcp", hbAPIIP+":0")
	must(t, err)
	t.Cleanup(func() { l.Close() })
	h.a.peerHBONEPort = uint16(l.Addr().(*net.TCPAddr).Port)
	bctx, stopB := context.WithCancel(ctx)
	h.stopB, h.bStopped = func() { stopB(); l.Close() }, make(chan struct{})
	go func() {
		defer close(h.bStopped)
		h.b.accept(bctx, l, h.b.inboundSlots, DirectionInbound, h.b.handleInbound)
	}()
	go h.b.enforcePolicies(ctx)

	// api's application.
	app, err := net.Listen("tcp", hbAPIIP+":0")
	must(t, err)
	t.Cleanup(func() { app.Close() })
	h.app = addrPort(app.Addr())
	go func() {
		for {
			c, err := app.Accept()
			if err != nil {
				return
			}
			h.appSaw <- addrPort(c.RemoteAddr())
			go func() {
				defer c.Close()
				fmt.Fprintf(c, "hello %s\n", c.RemoteAddr())
				c.SetDeadline(time.Now().Add(5 * time.Second))
				io.Copy(c, c)
			}()
		}
	}()
	return h
}

func (h *hbonePair) newProxy(node string, log *syncbuf.Buffer) *Proxy {
	p := New(Config{NodeName: node, TrustDomain: "cluster.local", IdleTimeout: time.Minute},
		slog.New(slog.NewTextHandler(log, nil)))
	web, api := *h.web, *h.api
	p.state.putWorkload("web", &web)
	p.state.putWorkload("api", &api)
	markSynced(p)
	return p
}

// markSynced: the proxy holds the node agent's whole view (as the xDS
// client says once its first answers are applied).
func markSynced(p *Proxy) { p.xds.syncOnce.Do(func() { close(p.xds.synced) }) }

// give makes ca issue p a certificate of id, through the same checks as
// a CA answer.
func (h *hbonePair) give(p *Proxy, ca *identity.Authority, id string) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	must(h.t, err)
	csrPEM, err := newCSR(key, id)
	must(h.t, err)
	block, _ := pem.Decode([]byte(csrPEM))
	csr, err := x509.ParseCertificateRequest(block.Bytes)
	must(h.t, err)
	issued, err := ca.SignWorkload(csr, id, time.Hour)
	must(h.t, err)
	held, err := verifyChain(issued.ChainPEM, key, id, time.Now())
	must(h.t, err)
	p.certs.put(id, held)
}

func newAuthority(t *testing.T) *identity.Authority {
	certPEM, keyPEM, err := identity.NewRootMaterial("cluster.local", 24*time.Hour)
	must(t, err)
	m, err := identity.ParseMaterial(certPEM, keyPEM, nil)
	must(t, err)
	a := &identity.Authority{}
	a.Set(m, nil)
	return a
}

// connect plays web: it connects to a's outbound side as if captured,
// and returns its end.
func (h *hbonePair) connect(t testing.TB, dst netip.AddrPort) net.Conn {
	return podConn(t, func(captured *net.TCPConn, src netip.AddrPort) {
		h.a.outboundHBONE(context.Background(), captured, src, dst, h.a.state.ByIP(src.Addr()), h.a.state.ByIP(dst.Addr()), dialFrom)
	})
}

// podConn is web's end of a connection whose other end, as captured by a
// proxy, serve handles in its own goroutine (src: web's address and port).
func podConn(t testing.TB, serve func(captured *net.TCPConn, src netip.AddrPort)) net.Conn {
	l, err := net.Listen("tcp", hbWebIP+":0")
	must(t, err)
	defer l.Close()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(hbWebIP)}}
	pod, err := d.Dial("tcp", l.Addr().String())
	must(t, err)
	t.Cleanup(func() { pod.Close() })
	accepted, err := l.Accept()
	must(t, err)
	go serve(accepted.(*net.TCPConn), addrPort(pod.LocalAddr()))
	pod.SetDeadline(time.Now().Add(5 * time.Second))
	return pod
}

// TestHBONE: a payload crosses the tunnel both ways with half-close, the
// application sees web's address as the source, both proxies count one
// HBONE connection and name both identities.
func TestHBONE(t *testing.T) {
	h := newHBONEPair(t)
	pod := h.connect(t, h.app)
	if _, err := pod.Write([]byte("ping\n")); err != nil {
		t.Fatal(err)
	}
	pod.(*net.TCPConn).CloseWrite()
	got, err := io.ReadAll(pod)
	if err != nil {
		t.Fatal(err)
	}
	want := "hello " + hbWebIP + ":"
	if !strings.HasPrefix(string(got), want) || !strings.HasSuffix(string(got), "\nping\n") {
		t.Fatalf("web read %q, want %q", got, want)
	}
	if saw := <-h.appSaw; saw.Addr() != netip.MustParseAddr(hbWebIP) {
		t.Errorf("api saw the connection from %s, want web's address", saw)
	}
	eventually(t, func() bool {
		return testutil.ToFloat64(h.a.metrics.ConnectionsClosed.WithLabelValues(DirectionOutbound, ProtocolHBONE)) == 1 &&
			testutil.ToFloat64(h.b.metrics.ConnectionsClosed.WithLabelValues(DirectionInbound, ProtocolHBONE)) == 1
	}, "both ends closed")
	if n := testutil.ToFloat64(h.a.metrics.SentBytes.WithLabelValues(DirectionOutbound, ProtocolHBONE)); n != 5 {
		t.Errorf("a counted %v bytes sent, want 5", n)
	}
	for _, l := range []string{h.aLog.String(), h.bLog.String()} {
		if !strings.Contains(l, "sourceIdentity="+hbWebID) || !strings.Contains(l, "destinationIdentity="+hbAPIID) {
			t.Errorf("log does not name both identities:\n%s", l)
		}
	}

	// A second and a third tunnel of the same pair, one while another is
	// open: streams on the first connection, no new handshake.
	open := h.connect(t, h.app)
	for range 2 {
		pod := h.connect(t, h.app)
		pod.(*net.TCPConn).CloseWrite()
		if got, err := io.ReadAll(pod); err != nil || !strings.HasPrefix(string(got), "hello "+hbWebIP+":") {
			t.Fatalf("pooled tunnel read %q, %v", got, err)
		}
	}
	open.Close()
	if n := testutil.ToFloat64(h.a.metrics.TunnelsDialed); n != 1 {
		t.Errorf("%v HBONE connections made for 4 tunnels of one pair, want 1", n)
	}
	if n := h.a.pool.size(); n != 1 {
		t.Errorf("pool holds %d connections, want 1", n)
	}
}

// TestStopClosesPeersConnections: a peer keeps its HBONE connection for
// reuse; a proxy that stops closes it rather than wait for the peer, and
// the peer sees it closed.
func TestStopClosesPeersConnections(t *testing.T) {
	h := newHBONEPair(t)
	pod := h.connect(t, h.app)
	pod.(*net.TCPConn).CloseWrite()
	if _, err := io.ReadAll(pod); err != nil {
		t.Fatal(err)
	}
	if n := h.a.pool.size(); n != 1 {
		t.Fatalf("a's pool holds %d connections, want the one to b, kept for reuse", n)
	}
	h.stopB()
	select {
	case <-h.bStopped:
	case <-time.After(5 * time.Second):
		t.Fatal("b still serves a's pooled connection 5 s after it stopped (a keeps it for a minute)")
	}
	eventually(t, func() bool { h.a.pool.sweep(); return h.a.pool.size() == 0 }, "a sees its pooled connection closed")
}

// TestHBONELarge: megabytes cross the tunnel both ways intact while the
// copy buffers switch between small and large.
func TestHBONELarge(t *testing.T) {
	h := newHBONEPair(t)
	pod := h.connect(t, h.app)
	pod.SetDeadline(time.Now().Add(30 * time.Second))
	sent := make([]byte, 4<<20+123)
	rand.Read(sent)
	go func() {
		pod.Write(sent)
		pod.(*net.TCPConn).CloseWrite()
	}()
	got, err := io.ReadAll(pod)
	if err != nil {
		t.Fatal(err)
	}
	_, echoed, _ := bytes.Cut(got, []byte("\n"))
	if !bytes.Equal(echoed, sent) {
		t.Fatalf("echoed %d bytes, sent %d; equal %v", len(echoed), len(sent), bytes.Equal(echoed, sent))
	}
}

// TestHBONERefusals: every way a tunnel must not open, with the reason
// each side counts. Never a byte reaches the application.
func TestHBONERefusals(t *testing.T) {
	h := newHBONEPair(t)
	other := newAuthority(t) // a CA the mesh does not trust

	t.Run("server is not the destination's identity", func(t *testing.T) {
		// a's view of api's identity differs from what b proves.
		wrong := *h.api
		wrong.Identity = "spiffe://cluster.local/ns/app/sa/db"
		h.a.state.putWorkload("api", &wrong)
		defer h.a.state.putWorkload("api", h.api)
		h.expectReset(t, h.connect(t, h.app))
		h.expectCount(t, h.a.metrics.HandshakeFailures.WithLabelValues(DirectionOutbound, "identity-mismatch"), 1)
		if l := h.aLog.String(); !strings.Contains(l, "sa/db (peer proved "+hbAPIID+")") {
			t.Errorf("a's refusal does not name the identity wanted and the one proved:\n%s", l)
		}
	})
	t.Run("no certificate for the source", func(t *testing.T) {
		h.a.certs.drop(map[string]bool{})
		defer h.give(h.a, h.ca, hbWebID)
		h.expectReset(t, h.connect(t, h.app))
		h.expectCount(t, h.a.metrics.Refused.WithLabelValues(DirectionOutbound, "no-certificate"), 1)
	})
	t.Run("client certificate of another CA", func(t *testing.T) {
		rogue := &Proxy{certs: NewCertificates(Config{}, NewState("x"), h.a.metrics, nil)}
		h.give(rogue, other, hbWebID)
		h.rogue(t, rogue.certs.Get(hbWebID))
		h.expectCount(t, h.b.metrics.HandshakeFailures.WithLabelValues(DirectionInbound, "bad-certificate"), 1)
	})
	t.Run("no client certificate", func(t *testing.T) {
		h.rogue(t, nil)
		h.expectCount(t, h.b.metrics.HandshakeFailures.WithLabelValues(DirectionInbound, "bad-certificate"), 2)
	})
	t.Run("not CONNECT", func(t *testing.T) {
		resp := h.request(t, hbWebIP, http.MethodGet, h.app.String())
		if resp.StatusCode != http.StatusMethodNotAllowed {
			t.Errorf("GET answered %s", resp.Status)
		}
	})
	t.Run("authority of another workload", func(t *testing.T) {
		resp := h.request(t, hbWebIP, http.MethodConnect, hbOtherIP+":80")
		if resp.StatusCode != http.StatusBadRequest {
			t.Errorf("CONNECT to another address answered %s", resp.Status)
		}
		h.expectCount(t, h.b.metrics.Refused.WithLabelValues(DirectionInbound, "authority-mismatch"), 1)
	})
	t.Run("a port of the proxy's own", func(t *testing.T) {
		// In-pod, these are the proxy's listeners in the pod: a loop, or a
		// tunnel in a tunnel.
		for _, port := range []string{"15001", "15006", "15008"} {
			if resp := h.request(t, hbWebIP, http.MethodConnect, hbAPIIP+":"+port); resp.StatusCode != http.StatusBadRequest {
				t.Errorf("CONNECT to api's port %s answered %s", port, resp.Status)
			}
		}
		h.expectCount(t, h.b.metrics.Refused.WithLabelValues(DirectionInbound, "loop"), 3)
	})
	t.Run("source address of another identity", func(t *testing.T) {
		resp := h.request(t, hbOtherIP, http.MethodConnect, h.app.String())
		if resp.StatusCode != http.StatusForbidden {
			t.Errorf("web's certificate from another address answered %s", resp.Status)
		}
		h.expectCount(t, h.b.metrics.Refused.WithLabelValues(DirectionInbound, "source-identity-mismatch"), 1)
	})
	t.Run("denied by policy", func(t *testing.T) {
		h.b.state.putPolicy("app/deny-web", &security.Authorization{Name: "deny-web", Namespace: "app", Scope: security.Scope_NAMESPACE,
			Action: security.Action_DENY, Groups: []*security.Group{{Rules: []*security.Rules{{Matches: []*security.Match{{
				Principals: []*security.StringMatch{{MatchType: &security.StringMatch_Exact{Exact: "cluster.local/ns/app/sa/web"}}},
			}}}}}}})
		defer h.b.state.deletePolicy("app/deny-web")
		h.expectReset(t, h.connect(t, h.app))
		h.expectCount(t, h.b.metrics.Refused.WithLabelValues(DirectionInbound, "denied"), 1)
		h.expectCount(t, h.a.metrics.Refused.WithLabelValues(DirectionOutbound, "tunnel-refused"), 1)
	})
	select {
	case saw := <-h.appSaw:
		t.Errorf("the application got a connection from %s", saw)
	default:
	}
}

// TestPolicyChangeClosesLiveTunnels: policies are checked again when they
// change, for the connections already open: one still allowed stays, one
// denied now ends.
func TestPolicyChangeClosesLiveTunnels(t *testing.T) {
	h := newHBONEPair(t)
	pod := h.connect(t, h.app)
	pod.SetDeadline(time.Now().Add(10 * time.Second))
	r := bufio.NewReader(pod)
	echo := func(msg string) (string, error) {
		if _, err := fmt.Fprintln(pod, msg); err != nil {
			return "", err
		}
		return r.ReadString('\n')
	}
	if line, err := r.ReadString('\n'); err != nil || !strings.HasPrefix(line, "hello ") {
		t.Fatalf("tunnel: %q, %v", line, err)
	}
	web := []*security.StringMatch{{MatchType: &security.StringMatch_Exact{Exact: "cluster.local/ns/app/sa/web"}}}
	policy := func(name string, action security.Action) *security.Authorization {
		return &security.Authorization{Name: name, Namespace: "app", Scope: security.Scope_NAMESPACE, Action: action,
			Groups: []*security.Group{{Rules: []*security.Rules{{Matches: []*security.Match{{Principals: web}}}}}}}
	}

	h.b.state.putPolicy("app/allow-web", policy("allow-web", security.Action_ALLOW))
	if line, err := echo("allowed"); line != "allowed\n" || err != nil {
		t.Fatalf("after an ALLOW for web the tunnel echoed %q, %v", line, err)
	}
	h.b.state.putPolicy("app/deny-web", denyWeb("deny-web"))
	h.expectCount(t, h.b.metrics.Refused.WithLabelValues(DirectionInbound, "denied-since"), 1)
	if line, err := echo("denied"); err == nil {
		t.Errorf("after a DENY for web the tunnel echoed %q", line)
	}
	eventually(t, func() bool { return strings.Contains(h.bLog.String(), "app/deny-web") }, "b's log names the policy that closed the tunnel")
}

// TestPolicyChangeDuringDial: a DENY that arrives while an allowed
// CONNECT dials the pod applies to it: the connection is registered
// before its first check.
func TestPolicyChangeDuringDial(t *testing.T) {
	h := newHBONEPair(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	dialing, release := make(chan struct{}), make(chan struct{})
	slow := func(ctx context.Context, src netip.Addr, dst netip.AddrPort) (*net.TCPConn, error) {
		close(dialing)
		<-release
		return dialFrom(ctx, src, dst)
	}
	l, err := net.Listen("tcp", hbAPIIP+":0")
	must(t, err)
	defer l.Close()
	go h.b.accept(ctx, l, h.b.inboundSlots, DirectionInbound, func(ctx context.Context, c *net.TCPConn) { h.b.inbound(ctx, c, slow) })
	h.a.peerHBONEPort = addrPort(l.Addr()).Port()
	pod := h.connect(t, h.app)
	<-dialing
	h.b.state.putPolicy("app/deny-web", denyWeb("deny-web"))
	h.expectCount(t, h.b.metrics.Refused.WithLabelValues(DirectionInbound, "denied-since"), 1)
	close(release)
	h.expectReset(t, pod)
}

// TestPolicyChangesDuringRecheck: a change that comes while the live
// connections are being checked is checked too. Many live connections
// make a check long enough for the second change to land in it.
func TestPolicyChangesDuringRecheck(t *testing.T) {
	p := New(Config{NodeName: "node-b", TrustDomain: "cluster.local"}, slog.New(slog.DiscardHandler))
	api := &Workload{UID: "api", Name: "api", Namespace: "app", Node: "node-b", Identity: hbAPIID,
		Addresses: []netip.Addr{netip.MustParseAddr(hbAPIIP)}}
	p.state.putWorkload("api", api)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go p.enforcePolicies(ctx)
	others := Connection{Source: netip.MustParseAddrPort(hbOtherIP + ":1"), Destination: netip.MustParseAddrPort(hbAPIIP + ":80"),
		SourceIdentity: "spiffe://cluster.local/ns/x/sa/y"}
	for range 5000 {
		p.live.add(ctx, api, others)
	}
	web := Connection{Source: netip.MustParseAddrPort(hbWebIP + ":1"), Destination: others.Destination, SourceIdentity: hbWebID}
	missed := 0
	for i := range 50 {
		live, done := p.live.add(ctx, api, web)
		// A change of another namespace's policy wakes a check that
		// still allows web; the DENY for web lands while it runs.
		p.state.putPolicy(fmt.Sprint("other/deny-", i), &security.Authorization{Name: "deny", Namespace: "other",
			Scope: security.Scope_NAMESPACE, Action: security.Action_DENY})
		time.Sleep(time.Millisecond)
		p.state.putPolicy("app/deny-web", denyWeb("deny-web"))
		select {
		case <-live.Done():
		case <-time.After(time.Second):
			missed++
		}
		done()
		p.state.deletePolicy("app/deny-web")
	}
	if missed > 0 {
		t.Errorf("%d of 50 DENYs did not close web's live connection", missed)
	}
}

func denyWeb(name string) *security.Authorization {
	web := []*security.StringMatch{{MatchType: &security.StringMatch_Exact{Exact: "cluster.local/ns/app/sa/web"}}}
	return &security.Authorization{Name: name, Namespace: "app", Scope: security.Scope_NAMESPACE, Action: security.Action_DENY,
		Groups: []*security.Group{{Rules: []*security.Rules{{Matches: []*security.Match{{Principals: web}}}}}}}
}

// TestOutboundToProxyPorts: a local mesh pod's address on one of the
// proxy's ports is refused as a loop (in-pod, the proxy listens there);
// a local pod out of the mesh has no proxy in it, and is reached there in
// plain TCP as on any port. Nothing is dialled: the dialer records.
func TestOutboundToProxyPorts(t *testing.T) {
	h := newHBONEPair(t)
	mesh, plain := netip.MustParseAddr("192.0.2.31"), netip.MustParseAddr("192.0.2.32")
	h.a.state.putWorkload("mesh", &Workload{UID: "mesh", Name: "mesh", Namespace: "app", Node: "node-a", HBONE: true,
		Identity: "spiffe://cluster.local/ns/app/sa/mesh", Addresses: []netip.Addr{mesh}})
	h.a.state.putWorkload("plain", &Workload{UID: "plain", Name: "plain", Namespace: "app", Node: "node-a",
		Addresses: []netip.Addr{plain}})
	dialled := make(chan netip.AddrPort, 2)
	recordOnly := func(_ context.Context, _ netip.Addr, dst netip.AddrPort) (*net.TCPConn, error) {
		dialled <- dst
		return nil, errors.New("not dialled in this test")
	}
	for _, dst := range []netip.AddrPort{netip.AddrPortFrom(mesh, InboundPlainPort), netip.AddrPortFrom(plain, InboundPlainPort)} {
		pod := podConn(t, func(captured *net.TCPConn, src netip.AddrPort) {
			h.a.outbound(context.Background(), captured, src, dst, nil, recordOnly)
		})
		io.ReadAll(pod)
	}
	h.expectCount(t, h.a.metrics.Refused.WithLabelValues(DirectionOutbound, "loop"), 1)
	select {
	case got := <-dialled:
		if got.Addr() != plain {
			t.Errorf("dialled %s; want only the plain pod", got)
		}
	case <-time.After(5 * time.Second):
		t.Errorf("the plain pod was not dialled")
	}
}

// TestIdleStrangersLeaveSlots: connections that never start a TLS
// handshake hold at most maxHandshakesPerSource of the node's slots per
// source address; beyond, they are reset at once, and a mesh peer's tunnel
// still gets a slot.
func TestIdleStrangersLeaveSlots(t *testing.T) {
	h := newHBONEPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	const perSource = 8
	b := h.newProxy("node-b", h.bLog)
	h.give(b, h.ca, hbAPIID)
	b.handshakes = newPerSource(perSource)
	b.inboundSlots = make(chan struct{}, perSource+1)
	l, err := net.Listen("tcp", hbAPIIP+":0")
	must(t, err)
	defer l.Close()
	go b.accept(ctx, l, b.inboundSlots, DirectionInbound, b.handleInbound)

	for range perSource + 1 {
		// On loopback the last one's reset may come before its dial
		// has seen its connection made.
		c, err := dialFrom(ctx, netip.MustParseAddr(hbOtherIP), addrPort(l.Addr()))
		if err != nil && !errors.Is(err, syscall.ECONNRESET) {
			t.Fatal(err)
		}
		if err == nil {
			defer c.Close()
		}
	}
	h.expectCount(t, b.metrics.Refused.WithLabelValues(DirectionInbound, "source-overloaded"), 1)
	eventually(t, func() bool { return len(b.inboundSlots) == perSource }, "the stranger holds its share of the slots")
	h.a.peerHBONEPort = addrPort(l.Addr()).Port()
	pod := h.connect(t, h.app)
	pod.SetDeadline(time.Now().Add(5 * time.Second))
	if line, err := bufio.NewReader(pod).ReadString('\n'); !strings.HasPrefix(line, "hello ") {
		t.Errorf("web's tunnel read %q, %v while a stranger held idle connections", line, err)
	}
}

// rogue connects to b's HBONE listener from web's address with cert (or
// none), trusting any server, and expects the server to refuse it.
func (h *hbonePair) rogue(t testing.TB, cert *tls.Certificate) {
	t.Helper()
	tcp, err := dialFrom(context.Background(), netip.MustParseAddr(hbWebIP), netip.AddrPortFrom(netip.MustParseAddr(hbAPIIP), h.a.peerHBONEPort))
	must(t, err)
	cfg := &tls.Config{InsecureSkipVerify: true, NextProtos: []string{"h2"}, MinVersion: tls.VersionTLS13}
	if cert != nil {
		cfg.Certificates = []tls.Certificate{*cert}
	}
	c := tls.Client(tcp, cfg)
	defer c.Close()
	err = c.Handshake()
	if err == nil {
		// TLS 1.3: the server's verdict on the client certificate arrives
		// after the client's side of the handshake is done.
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		_, err = c.Read(make([]byte, 1))
	}
	if err == nil || !strings.Contains(err.Error(), "certificate") {
		t.Errorf("a client with certificate %v was not refused: %v", cert != nil, err)
	}
}

// expectReset: the pod's connection ends without data.
func (h *hbonePair) expectReset(t testing.TB, pod net.Conn) {
	t.Helper()
	b, err := io.ReadAll(pod)
	if len(b) > 0 || err == nil {
		t.Errorf("refused connection read %q, %v; want a reset", b, err)
	}
}

// expectCount waits until the counter reaches want.
func (h *hbonePair) expectCount(t testing.TB, c prometheus.Counter, want float64) {
	t.Helper()
	eventually(t, func() bool { return testutil.ToFloat64(c) == want }, fmt.Sprintf("counter at %v (is %v)", want, testutil.ToFloat64(c)))
}

// request sends one HBONE request to b with web's certificate, from src.
func (h *hbonePair) request(t testing.TB, src, method, authority string) *http.Response {
	t.Helper()
	tcp, err := dialFrom(context.Background(), netip.MustParseAddr(src), netip.AddrPortFrom(netip.MustParseAddr(hbAPIIP), h.a.peerHBONEPort))
	must(t, err)
	var proved string
	conn := tls.Client(tcp, clientTLS(h.a.certs.Get(hbWebID), h.a.certs.Bundle(), "cluster.local", hbAPIID, &proved))
	must(t, conn.Handshake())
	t.Cleanup(func() { conn.Close() })
	cc, err := newHBONETransport().NewClientConn(conn)
	must(t, err)
	req := &http.Request{Method: method, URL: &url.URL{Scheme: "https", Host: authority, Path: "/"}, Host: authority, Header: http.Header{}}
	if method == http.MethodConnect {
		req.URL = &url.URL{Host: authority}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	t.Cleanup(cancel)
	resp, err := cc.RoundTrip(req.WithContext(ctx))
	must(t, err)
	return resp
}

// eventually polls cond (bounded: 10 s).
func eventually(t testing.TB, cond func() bool, what string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 10s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// TestWaitsForSync: an HBONE connection that comes before the proxy holds
// the node agent's view waits for it (a DENY policy or the destination
// could be in the part not yet received), then is served; one whose wait
// runs out is reset and counted.
func TestWaitsForSync(t *testing.T) {
	h := newHBONEPair(t)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	unsynced := func(wait time.Duration) (*Proxy, netip.AddrPort) {
		p := h.newProxy("node-b", &syncbuf.Buffer{})
		p.xds = NewXDS(p.cfg, p.state, p.metrics, p.log)
		p.syncWait = wait
		h.give(p, h.ca, hbAPIID)
		l, err := net.Listen("tcp", hbAPIIP+":0")
		must(t, err)
		t.Cleanup(func() { l.Close() })
		go p.accept(ctx, l, p.inboundSlots, DirectionInbound, p.handleInbound)
		return p, addrPort(l.Addr())
	}
	handshake := func(to netip.AddrPort) error {
		tcp, err := dialFrom(ctx, netip.MustParseAddr(hbWebIP), to)
		if err != nil {
			return err
		}
		var proved string
		c := tls.Client(tcp, clientTLS(h.a.certs.Get(hbWebID), h.a.certs.Bundle(), "cluster.local", hbAPIID, &proved))
		defer c.Close()
		c.SetDeadline(time.Now().Add(5 * time.Second))
		return c.Handshake()
	}

	refusing, at := unsynced(100 * time.Millisecond)
	if err := handshake(at); err == nil {
		t.Fatal("handshake with a proxy that never synced succeeded")
	}
	h.expectCount(t, refusing.metrics.Refused.WithLabelValues(DirectionInbound, "not-synced"), 1)

	// Outbound, from web to an address of no workload (plain TCP once
	// synced): nothing is dialled (the dialer only records), the pod's
	// connection is reset.
	outbound := h.newProxy("node-a", &syncbuf.Buffer{})
	outbound.xds = NewXDS(outbound.cfg, outbound.state, outbound.metrics, outbound.log)
	outbound.syncWait = 100 * time.Millisecond
	dialled := make(chan netip.AddrPort, 1)
	recordOnly := func(_ context.Context, _ netip.Addr, dst netip.AddrPort) (*net.TCPConn, error) {
		dialled <- dst
		return nil, errors.New("not dialled in this test")
	}
	pod := podConn(t, func(captured *net.TCPConn, src netip.AddrPort) {
		outbound.outbound(ctx, captured, src, netip.MustParseAddrPort("192.0.2.1:80"), nil, recordOnly)
	})
	h.expectReset(t, pod)
	h.expectCount(t, outbound.metrics.Refused.WithLabelValues(DirectionOutbound, "not-synced"), 1)
	select {
	case dst := <-dialled:
		t.Fatalf("dialled %s for a connection that came before sync", dst)
	default:
	}

	holding, at := unsynced(5 * time.Second)
	done := make(chan error, 1)
	go func() { done <- handshake(at) }()
	select {
	case err := <-done:
		t.Fatalf("handshake ended before the proxy synced: %v", err)
	case <-time.After(300 * time.Millisecond):
	}
	markSynced(holding)
	if err := <-done; err != nil {
		t.Fatalf("held connection after sync: %v", err)
	}
}
