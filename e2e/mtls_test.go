// SPDX-License-Identifier: Apache-2.0

package e2e_test

import (
	"bufio"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/netip"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/nftables"
	"github.com/vishvananda/netlink"

	"github.com/mtlsbridge/mtlsbridge/identity"
	"github.com/mtlsbridge/mtlsbridge/internal/netnstest"
	"github.com/mtlsbridge/mtlsbridge/proxy"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/bypass"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// TestMTLS proves on the two-node testbed, with a manifest folder as the
// cluster, that enrolled pods' traffic crosses the wire as mTLS and
// arrives intact, and that everything else is left as it was (checks 1 to
// 6 of issue 14, see runChecks).
func TestMTLS(t *testing.T) {
	b := newBed(t, newFolderCluster(t))
	for _, n := range b.nodes {
		n.expectSysmonAwake(t)
	}
	runChecks(t, b, nil)
}

// TestMTLSTunnel proves it in Cilium's tunnel routing mode (VXLAN, as
// Cilium's default): pods' packets cross the uplinks only encapsulated and
// HBONE from the other node arrives decapsulated on cilium_vxlan, where
// each agent attaches node-ingress by itself (--tunnel-devices' default).
// The underlay of the checks is node-a's tunnel device.
func TestMTLSTunnel(t *testing.T) { checkThroughDevice(t, bedConfig{tunnel: netnstest.TunnelVXLAN}) }

// TestMTLSTunnelOverWireGuard proves it in tunnel routing with WireGuard:
// the tunnel's packets cross cilium_wg0, where node_ingress_l3 passes
// them (UDP), and HBONE comes out of cilium_vxlan decapsulated.
func TestMTLSTunnelOverWireGuard(t *testing.T) {
	checkThroughDevice(t, bedConfig{tunnel: netnstest.TunnelVXLAN, overWireGuard: true})
}

// TestMTLSWireGuard proves it with Cilium's WireGuard in native routing:
// pods' packets cross the uplinks only as WireGuard's UDP, and HBONE from
// the other node arrives on cilium_wg0, an L3 device (no Ethernet header),
// which gets node_ingress_l3 (--tunnel-devices' default). The device is a
// tun whose packets a relay carries unencrypted (netnstest.TunnelWireGuard).
func TestMTLSWireGuard(t *testing.T) {
	checkThroughDevice(t, bedConfig{tunnel: netnstest.TunnelWireGuard})
}

// checkThroughDevice: pods' packets between the nodes cross the uplinks
// only inside the tunnel device's protocol; between enrolled pods they are
// mTLS on that device, to pods not enrolled in clear.
func checkThroughDevice(t *testing.T, cfg bedConfig) {
	b := newBedWith(t, newFolderCluster(t), cfg)
	p := startCheckPods(b)
	b.knows(p.a1.node, p.a1, p.b1, true)
	b.knows(p.b1.node, p.b1, p.a1, true)
	for _, v6 := range []bool{false, true} {
		for _, c := range []struct{ from, to *bedPod }{{p.a1, p.b1}, {p.b1, p.a1}} {
			f := b.run(c.from, c.to, v6)
			t.Log(f)
			expectMTLS(t, f)
		}
		f := b.run(p.a1, p.bplain, v6)
		t.Log(f)
		expectPlain(t, f, true)
		f = b.run(p.aplain, p.b1, v6)
		t.Log(f)
		expectPlain(t, f, false)
	}
	for _, n := range b.nodes {
		b.eventually(n.name+" bypass check", func() error { return n.noBypass() })
	}
	podRanges := []netip.Prefix{netip.MustParsePrefix("10.1.0.0/24"), netip.MustParsePrefix("10.2.0.0/24"),
		netip.MustParsePrefix("fd00:1::/64"), netip.MustParsePrefix("fd00:2::/64")}
	for _, s := range b.uplink.Segments() {
		for _, r := range podRanges {
			if r.Contains(s.Src.Addr()) || r.Contains(s.Dst.Addr()) {
				t.Fatalf("a pod's TCP on the uplink, not encapsulated: %s", s)
			}
		}
	}
}

// pods of the checks.
type checkPods struct {
	a1, a2, aplain, a3 *bedPod // node-a: enrolled, enrolled, not, enrolled later
	b1, bplain         *bedPod // node-b: enrolled, not
}

func startCheckPods(b *bed) checkPods {
	na, nb := b.nodes[0], b.nodes[1]
	return checkPods{
		a1: na.addPod("a1", "app", true, false), a2: na.addPod("a2", "app", true, false),
		aplain: na.addPod("aplain", "app", false, false), a3: na.addPod("a3", "app", false, false),
		b1: nb.addPod("b1", "app", true, false), bplain: nb.addPod("bplain", "app", false, false),
	}
}

// narration is how checks tell what they do: report logs each flow, or
// prints it to out (the demo); note prints the events between flows and
// step each check's name before running it as a subtest.
func narration(t *testing.T, out io.Writer) (report func(*flow), note func(string), step func(string, func(*testing.T))) {
	report = func(f *flow) { t.Log(f) }
	note = func(string) {}
	step = func(name string, fn func(t *testing.T)) { t.Run(name, fn) }
	if out != nil {
		report = func(f *flow) { fmt.Fprintln(out, "  "+f.String()) }
		note = func(s string) { fmt.Fprintln(out, "  -- "+s) }
		step = func(name string, fn func(t *testing.T)) {
			fmt.Fprintf(out, "\n== %s\n", name)
			t.Run(name, fn)
		}
	}
	return report, note, step
}

// runChecks runs the checks of the l2 mode, narrated to out when it is not
// nil (the demo).
func runChecks(t *testing.T, b *bed, out io.Writer) {
	p := startCheckPods(b)
	na, nb := b.nodes[0], b.nodes[1]
	report, note, step := narration(t, out)
	// Every enrolled pod is redirected (CNI ADD returned), so each proxy
	// must hear of it as HBONE, its own node's included.
	for _, c := range []struct {
		from, to *bedPod
	}{{p.a1, p.b1}, {p.a1, p.a2}, {p.b1, p.a1}} {
		b.knows(c.from.node, c.from, c.to, true)
	}
	b.knows(na, p.a1, p.bplain, false)

	step("1 enrolled to enrolled across nodes is mTLS", func(t *testing.T) {
		for _, v6 := range []bool{false, true} {
			for _, c := range []struct{ from, to *bedPod }{{p.a1, p.b1}, {p.b1, p.a1}} {
				f := b.run(c.from, c.to, v6)
				report(f)
				expectMTLS(t, f)
			}
		}
		// Nothing of an enrolled pod bypasses: kernel state and the
		// proxy's xDS acknowledgement, as the agent checks them.
		for _, n := range b.nodes {
			b.eventually(n.name+" bypass check", func() error { return n.noBypass() })
		}
	})

	step("2 plain where a side is not enrolled", func(t *testing.T) {
		for _, v6 := range []bool{false, true} {
			before := na.metric("mtlsbridge_proxy_connections_opened_total")
			f := b.run(p.a1, p.bplain, v6)
			report(f)
			expectPlain(t, f, true)
			if got := na.metric("mtlsbridge_proxy_connections_opened_total", `protocol="plain"`); got < 1 {
				t.Errorf("node-a's proxy counts %v plain connections", got)
			}
			for _, c := range []struct{ from, to *bedPod }{{p.aplain, p.b1}, {p.aplain, p.bplain}} {
				f := b.run(c.from, c.to, v6)
				report(f)
				expectPlain(t, f, false)
			}
			if after := na.metric("mtlsbridge_proxy_connections_opened_total"); after != before+1 {
				t.Errorf("node-a's proxy opened %v connections for one enrolled source", after-before)
			}
		}
	})

	step("3 same node is not proxied", func(t *testing.T) {
		for _, v6 := range []bool{false, true} {
			before := na.metric("mtlsbridge_proxy_connections_opened_total")
			f := b.run(p.a1, p.a2, v6)
			report(f)
			if f.err != nil || f.reply.server != "a2" || f.reply.remote.Addr() != p.a1.addr(v6) {
				t.Errorf("a1 -> a2: %+v %v", f.reply, f.err)
			}
			if f.out != nil || len(f.segments) > 0 {
				t.Errorf("same-node flow went through the proxy (%v) or the underlay (%d segments)", f.out, len(f.segments))
			}
			if after := na.metric("mtlsbridge_proxy_connections_opened_total"); after != before {
				t.Errorf("node-a's proxy opened %v connections for a same-node flow", after-before)
			}
		}
	})

	step("4 clients without a mesh certificate are refused on 15008", func(t *testing.T) {
		before := nb.metric("mtlsbridge_proxy_handshake_failures_total", `direction="inbound"`)
		other := foreignCertificate(t, "spiffe://cluster.local/ns/app/sa/aplain")
		for _, c := range []struct {
			name string
			cert *tls.Certificate
		}{{"certificate of another CA", other}, {"no certificate", nil}} {
			err := tlsTo(p.aplain, netip.AddrPortFrom(p.b1.ip4, proxy.HBONEPort), c.cert)
			report(&flow{from: p.aplain, to: p.b1, dst: netip.AddrPortFrom(p.b1.ip4, proxy.HBONEPort), err: fmt.Errorf("TLS with %s: %w", c.name, orOK(err))})
			if err == nil {
				t.Errorf("%s: b1:15008 answered the CONNECT", c.name)
			}
		}
		if after := nb.metric("mtlsbridge_proxy_handshake_failures_total", `direction="inbound"`); after != before+2 {
			t.Errorf("node-b's proxy counts %v failed inbound handshakes, want 2", after-before)
		}
	})

	step("5 proxy killed fails closed and recovers; agent restart keeps flows", func(t *testing.T) {
		restartsFailClosed(t, b, p, "xds", nil, report, note)
	})

	step("6 enrolled while running, then unenrolled", func(t *testing.T) {
		f := b.run(p.a3, p.b1, false)
		report(f)
		expectPlain(t, f, false)
		b.setEnrolled(p.a3, true)
		note("a3 labelled " + tables.RedirTypeLabel + "=" + tables.RedirTypeWorkload)
		b.knows(na, p.a3, p.b1, true)
		b.eventually("a3 redirected", func() error { return na.noBypass("a3") })
		for _, v6 := range []bool{false, true} {
			f := b.run(p.a3, p.b1, v6)
			report(f)
			expectMTLS(t, f)
		}
		b.setEnrolled(p.a3, false)
		note("a3's label removed")
		// Until the agent has detached a3's program, a new connection
		// may be refused by the proxy (a3 is no workload any more), never
		// sent in clear through it.
		b.eventually("a3 plain again", func() error {
			f = b.run(p.a3, p.b1, false)
			if f.err != nil || f.out != nil || !f.visible {
				return fmt.Errorf("%s", f)
			}
			return nil
		})
		report(f)
		expectPlain(t, f, false)
	})

	step("7 a proxy stopped cleanly removes its capture and still fails closed", func(t *testing.T) {
		na.stopProxy()
		note("node-a's proxy stopped (SIGTERM)")
		if left := captureLeft(t, na.proxyPod); left != "" {
			t.Errorf("after a clean exit: %s", left)
		}
		f := b.run(p.a1, p.b1, false)
		report(f)
		if f.err == nil || f.visible || len(f.plainSegments()) > 0 {
			t.Errorf("without a proxy, a1 -> b1: %v, payload visible %v, segments on the underlay %v", f.err, f.visible, f.plainSegments())
		}
		na.startProxy()
		na.waitProxyReady()
		note("node-a's proxy started again")
		b.knows(na, p.a1, p.b1, true)
		f = b.run(p.a1, p.b1, false)
		report(f)
		expectMTLS(t, f)
	})

	step("8 a pod deleted by force while it runs stays closed", func(t *testing.T) {
		b.cluster.deletePod(p.a2)
		note("a2 deleted by force; its sandbox runs on")
		// Its Workload goes; its steering stays until its veth goes: the
		// proxy refuses a source it does not know.
		b.eventually("node-a's proxy forgets a2", func() error {
			d, err := na.configDump()
			if err == nil && dumped(d, p.a2) != nil {
				err = fmt.Errorf("a2 is still a workload")
			}
			return err
		})
		refused := func(when string) {
			for _, v6 := range []bool{false, true} {
				f := b.run(p.a2, p.b1, v6)
				report(f)
				if f.err == nil || f.visible || len(f.plainSegments()) > 0 {
					t.Errorf("a2 deleted%s, a2 -> b1: %v, payload visible %v, segments on the underlay %v", when, f.err, f.visible, f.plainSegments())
				}
			}
		}
		refused("")
		// A restarted agent never saw a2, and prunes once ready: it keeps
		// the steering the previous one left while the veth is there.
		na.killAgent()
		na.startAgent()
		na.waitAgent()
		note("node-a's agent restarted (SIGKILL)")
		refused(", then node-a's agent restarted")
	})
}

// captureLeft describes what of a proxy's capture is in its pod's
// namespace: the nftables table, fwmark rules, routes of its table.
func captureLeft(t *testing.T, pod *bedPod) string {
	var left []string
	conn, err := nftables.New(nftables.WithNetNSFd(int(pod.ns.Handle)))
	must(t, err)
	tables, err := conn.ListTablesOfFamily(nftables.TableFamilyINet)
	must(t, err)
	for _, tb := range tables {
		if tb.Name == proxy.DefaultCaptureTable {
			left = append(left, "table inet "+tb.Name)
		}
	}
	h := pod.ns.Netlink(t)
	for _, family := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
		rules, err := h.RuleList(family)
		must(t, err)
		for _, r := range rules {
			if r.Table == proxy.DefaultRouteTable {
				left = append(left, "rule "+r.String())
			}
		}
		routes, err := h.RouteListFiltered(family, &netlink.Route{Table: proxy.DefaultRouteTable}, netlink.RT_FILTER_TABLE)
		must(t, err)
		for _, r := range routes {
			left = append(left, "route "+r.String())
		}
	}
	return strings.Join(left, "; ")
}

// expectMTLS: the payload arrived intact with the source pod's address;
// both proxies recorded the tunnel with the two pods' identities as each
// peer proved them (in the handshake of the HBONE connection the tunnel
// runs on); on the underlay only TLS records to and from port 15008 of
// the destination, and no byte of the payload.
func expectMTLS(t *testing.T, f *flow) {
	t.Helper()
	src := f.from.addr(f.dst.Addr().Is6())
	switch {
	case f.err != nil:
		t.Errorf("%s -> %s: %v", f.from, f.dst, f.err)
		return
	case f.reply.server != f.to.name || f.reply.remote.Addr() != src:
		t.Errorf("%s -> %s: answered by %s, which saw the connection from %s, want %s", f.from, f.dst, f.reply.server, f.reply.remote, src)
	case f.out == nil || f.out["protocol"] != proxy.ProtocolHBONE:
		t.Errorf("%s -> %s: the source node's proxy did not tunnel it: %v", f.from, f.dst, f.out)
	case f.in == nil:
		t.Errorf("%s -> %s: the destination node's proxy did not terminate it", f.from, f.dst)
	case f.out["sourceIdentity"] != f.from.identity() || f.out["destinationIdentity"] != f.to.identity() ||
		f.in["sourceIdentity"] != f.from.identity() || f.in["destinationIdentity"] != f.to.identity():
		t.Errorf("%s -> %s: identities out %s -> %s, in %s -> %s; want %s -> %s", f.from, f.dst,
			f.out["sourceIdentity"], f.out["destinationIdentity"], f.in["sourceIdentity"], f.in["destinationIdentity"],
			f.from.identity(), f.to.identity())
	case f.visible:
		t.Errorf("%s -> %s: the payload crossed the underlay in clear", f.from, f.dst)
	}
	var firstOut, firstIn *[]byte
	var other []netnstest.Segment
	for _, s := range f.segments {
		toServer := s.Dst.Addr() == f.dst.Addr()
		if (toServer && s.Dst.Port() != proxy.HBONEPort) || (!toServer && s.Src.Port() != proxy.HBONEPort) {
			other = append(other, s)
			continue
		}
		if s.Payload > 0 && toServer && firstOut == nil {
			firstOut = &s.Head
		}
		if s.Payload > 0 && !toServer && firstIn == nil {
			firstIn = &s.Head
		}
	}
	if len(other) > 0 {
		t.Errorf("%s -> %s: %d segments on the underlay not to or from port 15008, the first: %s", f.from, f.dst, len(other), other[0])
	}
	// Each direction's first payload is a TLS record header: handshake
	// (22) on a new HBONE connection, application data (23) on one the
	// tunnel shares; record version 3.1 (a ClientHello's) to 3.3.
	for _, h := range []*[]byte{firstOut, firstIn} {
		if h == nil || len(*h) < 3 || ((*h)[0] != 0x16 && (*h)[0] != 0x17) || (*h)[1] != 0x03 || (*h)[2] < 1 || (*h)[2] > 3 {
			t.Errorf("%s -> %s: the underlay shows no TLS record each way (first payloads %v, %v) among %d segments",
				f.from, f.dst, firstOut, firstIn, len(f.segments))
			break
		}
	}
}

// expectPlain: the payload arrived intact from the source pod's address,
// went in clear on the underlay (this is the capture seeing payload), and
// through the source node's proxy only when the source is enrolled.
func expectPlain(t *testing.T, f *flow, viaProxy bool) {
	t.Helper()
	src := f.from.addr(f.dst.Addr().Is6())
	switch {
	case f.err != nil:
		t.Errorf("%s -> %s: %v", f.from, f.dst, f.err)
	case f.reply.server != f.to.name || f.reply.remote.Addr() != src:
		t.Errorf("%s -> %s: answered by %s from %s, want %s from %s", f.from, f.dst, f.reply.server, f.reply.remote, f.to.name, src)
	case !f.visible:
		t.Errorf("%s -> %s: plain payload not seen on the underlay", f.from, f.dst)
	case f.in != nil:
		t.Errorf("%s -> %s: terminated by the destination's proxy: %v", f.from, f.dst, f.in)
	case viaProxy && (f.out == nil || f.out["protocol"] != proxy.ProtocolPlain):
		t.Errorf("%s -> %s: want plain through the source's proxy, got %v", f.from, f.dst, f.out)
	case !viaProxy && f.out != nil:
		t.Errorf("%s -> %s: went through the source's proxy: %v", f.from, f.dst, f.out)
	}
}

// noBypass runs `mtlsbridge bypass` on the node: nothing enrolled
// bypasses, with the xDS acknowledgement of the real proxy included; the
// pods named must be among those checked.
//
// After the agent restarted, the pods named are held to every check but
// the others only to the kernel's: the agent counts as acknowledged only
// Workloads it sent on the current stream, and the proxy reconnects with
// initial_resource_versions, so the agent rightly does not send again what
// the proxy holds, and then reports those pods "not acknowledged" (a gap
// of the node agent, reported with this work).
func (n *bedNode) noBypass(pods ...string) error {
	cmd := exec.Command(filepath.Join(n.bed.bin, "mtlsbridge"), "bypass", "-o", "json", "--state-dir="+n.stateDir)
	out, _ := cmd.Output() // exit 1 with gaps: the report says which
	var rep bypass.Report
	if err := json.Unmarshal(out, &rep); err != nil {
		return fmt.Errorf("mtlsbridge bypass: %v: %s", err, out)
	}
	var checked []string
	for _, row := range rep.Pods {
		name := strings.TrimPrefix(row.Pod, "app/")
		checked = append(checked, name)
		gaps := row.Gaps
		if len(pods) > 0 && !slices.Contains(pods, name) {
			gaps = slices.DeleteFunc(slices.Clone(gaps), func(g string) bool { return g == bypass.GapNotAcked })
		}
		if len(gaps) > 0 {
			return fmt.Errorf("%s bypasses: %v", row.Pod, gaps)
		}
	}
	for _, p := range pods {
		if !slices.Contains(checked, p) {
			return fmt.Errorf("%s not among the checked pods %v", p, checked)
		}
	}
	return nil
}

// echoConn is a long-lived connection to an echo server.
type echoConn struct {
	c net.Conn
	r *bufio.Reader
}

func openEcho(t *testing.T, from *bedPod, dst netip.AddrPort) *echoConn {
	var c net.Conn
	must(t, from.ns.Do(func() (err error) {
		c, err = net.DialTimeout("tcp", dst.String(), requestTimeout)
		return err
	}))
	t.Cleanup(func() { c.Close() })
	return &echoConn{c: c, r: bufio.NewReader(c)}
}

func (e *echoConn) roundTrip(t *testing.T, marker []byte) {
	t.Helper()
	line := fmt.Sprintf("%s %d\n", marker, time.Now().UnixNano())
	e.c.SetDeadline(time.Now().Add(requestTimeout))
	if _, err := e.c.Write([]byte(line)); err != nil {
		t.Fatalf("long-lived connection: write: %v", err)
	}
	got, err := e.r.ReadString('\n')
	if err != nil || got != line {
		t.Fatalf("long-lived connection: read %q, %v; want %q", got, err, line)
	}
}

func (e *echoConn) close() { e.c.Close() }

// foreignCertificate is a workload certificate of a CA the mesh does not
// trust.
func foreignCertificate(t *testing.T, id string) *tls.Certificate {
	certPEM, keyPEM, err := identity.NewRootMaterial("cluster.local", time.Hour)
	must(t, err)
	m, err := identity.ParseMaterial(certPEM, keyPEM, nil)
	must(t, err)
	ca := &identity.Authority{}
	ca.Set(m, nil)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	must(t, err)
	u, _ := url.Parse(id)
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{URIs: []*url.URL{u}}, key)
	must(t, err)
	csr, err := x509.ParseCertificateRequest(der)
	must(t, err)
	issued, err := ca.SignWorkload(csr, id, time.Hour)
	must(t, err)
	return &tls.Certificate{Certificate: [][]byte{issued.Leaf.Raw}, PrivateKey: key, Leaf: issued.Leaf}
}

// tlsTo plays a client that trusts any server: TLS 1.3 with h2 to dst from
// the pod, with cert (or none), then the HTTP/2 preface. It returns nil
// only if the server went on to speak HTTP/2 with it.
func tlsTo(from *bedPod, dst netip.AddrPort, cert *tls.Certificate) error {
	var raw net.Conn
	err := from.ns.Do(func() (err error) {
		raw, err = net.DialTimeout("tcp", dst.String(), requestTimeout)
		return err
	})
	if err != nil {
		return err
	}
	cfg := &tls.Config{InsecureSkipVerify: true, NextProtos: []string{"h2"}, MinVersion: tls.VersionTLS13}
	if cert != nil {
		cfg.Certificates = []tls.Certificate{*cert}
	}
	c := tls.Client(raw, cfg)
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), requestTimeout)
	defer cancel()
	if err := c.HandshakeContext(ctx); err != nil {
		return err
	}
	// TLS 1.3: the server judges the client certificate after the
	// client's handshake; the preface then meets the verdict.
	c.SetDeadline(time.Now().Add(requestTimeout))
	fmt.Fprintf(c, "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
	buf := make([]byte, 1)
	if _, err := c.Read(buf); err != nil {
		return err
	}
	// The server spoke HTTP/2 (its SETTINGS): the client was accepted.
	return nil
}

func orOK(err error) error {
	if err == nil {
		return fmt.Errorf("accepted")
	}
	return err
}

// restartsFailClosed is check 5 in either mode. node-a's proxy killed: new
// connections from a1 to b1 fail, with nothing in clear on the underlay
// (kept, if given, tells that the mode's redirection of a1 stays); started
// again: they are mTLS, no pod restarted. Then a long-lived connection
// through both proxies, and new ones, while node-a's agent is killed and
// restarted: it echoes on, nothing crosses in clear, and the proxy comes
// back to the agent (its mtlsbridge_proxy_<stream>_connects_total: xds,
// or zds in in-pod mode) with a1 redirected again.
func restartsFailClosed(t *testing.T, b *bed, p checkPods, stream string, kept func() bool, report func(*flow), note func(string)) {
	na := b.nodes[0]
	// A pooled connection, idle when its proxy dies: the proxy's end
	// closes, and soon no socket is left of it (its FIN_WAIT2 lasts 1 s
	// here, not 60). The pod's next write on it must not go on to b1 in
	// clear.
	pooled := openEcho(t, p.a1, netip.AddrPortFrom(p.b1.ip4, echoPort))
	pooled.roundTrip(t, newMarker("pooled"))
	must(t, na.proxyPod.ns.Do(func() error {
		return os.WriteFile("/proc/sys/net/ipv4/tcp_fin_timeout", []byte("1"), 0o644)
	}))
	na.killProxy()
	note("node-a's proxy killed (SIGKILL)")
	time.Sleep(2 * time.Second)
	late := newMarker("pooled-late")
	b.underlay.Watch(late)
	pooled.c.SetWriteDeadline(time.Now().Add(requestTimeout))
	_, lateErr := pooled.c.Write(late)
	time.Sleep(captureLag)
	if seen := b.underlay.Seen(late); len(seen) > 0 {
		t.Errorf("a write on a connection whose proxy died crossed the underlay in clear: %v", seen[0])
	}
	note(fmt.Sprintf("a1 wrote on its pooled connection to b1, proxy dead (write: %v); nothing in clear", lateErr))
	pooled.close()
	// Both families at once: each waits for its connection to fail.
	var down [2]*flow
	var wg sync.WaitGroup
	for i, v6 := range []bool{false, true} {
		wg.Add(1)
		go func() { defer wg.Done(); down[i] = b.run(p.a1, p.b1, v6) }()
	}
	wg.Wait()
	for _, f := range down {
		report(f)
		// The HBONE connections the dead proxy held close (their
		// segments to and from 15008); nothing else may leave.
		if f.err == nil || f.visible || len(f.plainSegments()) > 0 {
			t.Errorf("with the proxy down, a1 -> b1: %v, payload visible %v, segments on the underlay %v", f.err, f.visible, f.plainSegments())
		}
	}
	if kept != nil && !kept() {
		t.Error("a1 lost its redirection when the proxy died")
	}
	na.startProxy()
	na.waitProxyReady()
	note("node-a's proxy started again, ready; no pod restarted")
	b.knows(na, p.a1, p.b1, true)
	for _, v6 := range []bool{false, true} {
		f := b.run(p.a1, p.b1, v6)
		report(f)
		expectMTLS(t, f)
	}

	echo := openEcho(t, p.a1, netip.AddrPortFrom(p.b1.ip4, echoPort))
	marker := newMarker("echo")
	b.underlay.Watch(marker)
	echo.roundTrip(t, marker)
	connects := "mtlsbridge_proxy_" + stream + "_connects_total"
	before := na.metric(connects)
	na.killAgent()
	note("node-a's agent killed (SIGKILL); a long-lived connection a1 -> b1:8081 echoes on")
	for range 3 {
		echo.roundTrip(t, marker)
		time.Sleep(100 * time.Millisecond)
	}
	f := b.run(p.a1, p.b1, false)
	report(f)
	expectMTLS(t, f)
	na.startAgent()
	na.waitAgent()
	note("node-a's agent started again")
	echo.roundTrip(t, marker)
	b.eventually("node-a's proxy back on "+stream, func() error {
		if n := na.metric(connects); n <= before {
			return fmt.Errorf("%v %s connects", n, stream)
		}
		return nil
	})
	b.eventually("a1 redirected again", func() error { return na.noBypass("a1") })
	echo.roundTrip(t, marker)
	echo.close()
	f = b.run(p.a1, p.b1, true)
	report(f)
	expectMTLS(t, f)
	time.Sleep(captureLag)
	if seen := b.underlay.Seen(marker); len(seen) > 0 {
		t.Errorf("the long-lived connection's payload crossed the underlay in clear: %v", seen[0])
	}
}
