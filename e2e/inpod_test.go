// SPDX-License-Identifier: Apache-2.0

package e2e_test

import (
	"crypto/tls"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/google/nftables"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/mtlsbridge/mtlsbridge/proxy"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/inpod"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// TestInPodMTLS proves the in-pod mode on the two-node testbed as TestMTLS
// proves the l2 mode: the agents run with --redirect-mode=inpod and the
// reference mTLS agent runs as ztunnel does in its in-pod mode (ZDS, its
// listeners inside each pod's namespace). Enrolled pods' traffic crosses
// the wire only as mTLS and arrives intact; a proxy that dies or stops
// leaves the pods' connections refused, never in clear; the agent's
// restart keeps flows; a pod enrolled and unenrolled while running gains
// and loses its redirection; a pod deleted by force keeps it.
func TestInPodMTLS(t *testing.T) {
	b := newBedWith(t, newFolderCluster(t), bedConfig{inPod: true})
	runInPodChecks(t, b, nil)
}

// runInPodChecks runs the checks of the in-pod mode, narrated to out when
// it is not nil (the demo).
func runInPodChecks(t *testing.T, b *bed, out io.Writer) {
	p := startCheckPods(b)
	na, nb := b.nodes[0], b.nodes[1]
	report, note, step := narration(t, out)
	for _, c := range []struct{ from, to *bedPod }{{p.a1, p.b1}, {p.a1, p.a2}, {p.b1, p.a1}} {
		b.knows(c.from.node, c.from, c.to, true)
	}
	b.knows(na, p.a1, p.bplain, false)

	step("0 each enrolled pod is handed to its proxy as itself, with its redirection", func(t *testing.T) {
		for _, pod := range []*bedPod{p.a1, p.a2, p.b1} {
			if err := inPodInPlace(pod); err != nil {
				t.Error(err)
			}
		}
		// The l2 datapath contributes nothing: nothing pinned on bpffs.
		for _, n := range b.nodes {
			if pins, _ := os.ReadDir(n.bpfRoot); len(pins) > 0 {
				t.Errorf("%s's agent pinned %d objects under %s in the in-pod mode", n.name, len(pins), n.bpfRoot)
			}
		}
		for _, pod := range []*bedPod{p.aplain, p.a3, p.bplain} {
			if present := inPodRulesPresent(t, pod); present {
				t.Errorf("%s is not enrolled, but holds the in-pod redirection", pod)
			}
		}
		// The proxy got exactly the Workloads' name, namespace and service
		// account in ZDS (what ztunnel matches its xDS Workload on).
		d, err := na.configDump()
		must(t, err)
		var got []string
		for _, pod := range d.Pods {
			got = append(got, fmt.Sprintf("%s/%s sa=%s", pod.Namespace, pod.Name, pod.ServiceAccount))
		}
		if want := []string{"app/a1 sa=a1", "app/a2 sa=a2"}; !slices.Equal(sortedStrings(got), want) {
			t.Errorf("node-a's proxy serves %q, want %q", got, want)
		}
	})

	step("1 enrolled to enrolled across nodes is mTLS", func(t *testing.T) {
		for _, v6 := range []bool{false, true} {
			for _, c := range []struct{ from, to *bedPod }{{p.a1, p.b1}, {p.b1, p.a1}} {
				f := b.run(c.from, c.to, v6)
				report(f)
				expectMTLS(t, f)
			}
		}
		for _, n := range b.nodes {
			b.eventually(n.name+" bypass check", func() error { return n.noBypass() })
		}
	})

	step("2 plain where a side is not enrolled", func(t *testing.T) {
		for _, v6 := range []bool{false, true} {
			f := b.run(p.a1, p.bplain, v6)
			report(f)
			expectPlainInPod(t, f, true, false)
			// Plain into an enrolled pod is redirected inside it to the
			// proxy (15006), which hands it to the pod from the client's
			// own address.
			f = b.run(p.aplain, p.b1, v6)
			report(f)
			expectPlainInPod(t, f, false, true)
			f = b.run(p.aplain, p.bplain, v6)
			report(f)
			expectPlainInPod(t, f, false, false)
		}
	})

	step("3 same node stays on the node", func(t *testing.T) {
		for _, v6 := range []bool{false, true} {
			f := b.run(p.a1, p.a2, v6)
			report(f)
			if f.err != nil || f.reply.server != "a2" || f.reply.remote.Addr() != p.a1.addr(v6) {
				t.Errorf("a1 -> a2: %+v %v", f.reply, f.err)
			}
			if len(f.segments) > 0 {
				t.Errorf("same-node flow crossed the underlay (%d segments)", len(f.segments))
			}
		}
	})

	step("4 clients without a mesh certificate are refused on 15008", func(t *testing.T) {
		before := nb.metric("mtlsbridge_proxy_handshake_failures_total", `direction="inbound"`)
		other := foreignCertificate(t, "spiffe://cluster.local/ns/app/sa/aplain")
		for _, cert := range []*tls.Certificate{other, nil} {
			if err := tlsTo(p.aplain, netip.AddrPortFrom(p.b1.ip4, proxy.HBONEPort), cert); err == nil {
				t.Errorf("b1:15008 (the proxy's listener in b1) answered a client with certificate %v", cert != nil)
			}
		}
		// The proxy counts a refusal once its side of the handshake ends,
		// which may be after the client's.
		b.eventually("node-b's proxy counts both refusals", func() error {
			if after := nb.metric("mtlsbridge_proxy_handshake_failures_total", `direction="inbound"`); after != before+2 {
				return fmt.Errorf("%v failed inbound handshakes, want 2", after-before)
			}
			return nil
		})
	})

	step("5 proxy killed fails closed and recovers; agent restart keeps flows", func(t *testing.T) {
		// The redirection is the node agent's: it stays while the proxy
		// is down.
		restartsFailClosed(t, b, p, "zds", func() bool { return inPodRulesPresent(t, p.a1) }, report, note)
	})

	step("6 enrolled while running, then unenrolled", func(t *testing.T) {
		f := b.run(p.a3, p.b1, false)
		report(f)
		expectPlainInPod(t, f, false, true)
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
		// Until the redirection is removed a new connection may be refused
		// (the proxy no longer serves a3), never sent in clear by it.
		b.eventually("a3 plain again", func() error {
			f = b.run(p.a3, p.b1, false)
			if f.err != nil || f.out != nil || !f.visible {
				return fmt.Errorf("%s", f)
			}
			return nil
		})
		report(f)
		expectPlainInPod(t, f, false, true)
		if inPodRulesPresent(t, p.a3) {
			t.Error("a3's redirection stayed after it was unenrolled")
		}
	})

	step("7 a proxy stopped cleanly still fails closed", func(t *testing.T) {
		na.stopProxy()
		note("node-a's proxy stopped (SIGTERM)")
		f := b.run(p.a1, p.b1, false)
		report(f)
		if f.err == nil || f.visible || len(f.plainSegments()) > 0 {
			t.Errorf("without a proxy, a1 -> b1: %v, payload visible %v, segments on the underlay %v", f.err, f.visible, f.plainSegments())
		}
		// The kubelet's probes need no proxy: node-a's own connections to
		// a1 come from the probe address, which a1's redirection lets in;
		// those to aplain keep the node's source.
		for i, probe := range []netip.Addr{inpod.ProbeSNAT4, inpod.ProbeSNAT6} {
			v6 := i == 1
			r, err := sendFrom(na.ns.NS, netip.AddrPortFrom(p.a1.addr(v6), digestPort), []byte("probe"))
			if err != nil || r.server != "a1" || r.remote.Addr() != probe {
				t.Errorf("without a proxy, node-a -> a1: %+v %v, want a1 from %s", r, err, probe)
			} else {
				note(fmt.Sprintf("node-a -> a1 %s (a kubelet's probe): answered, from %s (--probe-snat)", p.a1.addr(v6), probe))
			}
			r, err = sendFrom(na.ns.NS, netip.AddrPortFrom(p.aplain.addr(v6), digestPort), []byte("probe"))
			if err != nil || r.server != "aplain" || r.remote.Addr() == probe {
				t.Errorf("node-a -> aplain: %+v %v, want aplain from the node's address", r, err)
			}
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
		// The proxy is told to drop a2 (ZDS) and forgets its Workload; its
		// redirection stays in its namespace until the namespace goes.
		b.eventually("node-a's proxy drops a2", func() error {
			d, err := na.configDump()
			if err != nil {
				return err
			}
			for _, pod := range d.Pods {
				if pod.Name == p.a2.name && pod.Namespace == p.a2.namespace {
					return fmt.Errorf("a2 is still served in its namespace")
				}
			}
			if dumped(d, p.a2) != nil {
				return fmt.Errorf("a2 is still a workload")
			}
			return nil
		})
		stayedClosed := func(when string) {
			for _, v6 := range []bool{false, true} {
				f := b.run(p.a2, p.b1, v6)
				report(f)
				if f.err == nil || f.visible || len(f.plainSegments()) > 0 {
					t.Errorf("a2 deleted%s, a2 -> b1: %v, payload visible %v, segments on the underlay %v", when, f.err, f.visible, f.plainSegments())
				}
			}
			if !inPodRulesPresent(t, p.a2) {
				t.Errorf("a2 deleted%s: its redirection left its namespace", when)
			}
		}
		stayedClosed("")
		// A restarted agent never saw a2, and prunes once ready: it
		// leaves the redirection in a2's namespace.
		na.killAgent()
		na.startAgent()
		na.waitAgent()
		note("node-a's agent restarted (SIGKILL)")
		stayedClosed(", then node-a's agent restarted")
	})

	step("9 pods no CNI report names are found", func(t *testing.T) {
		// As on a node where mtlsbridge is installed: its pods started
		// before the plugin was chained, the agent has no report of them
		// (nor a first start of this boot). a1 is enrolled, a3 runs
		// unenrolled.
		na.killAgent()
		must(t, os.RemoveAll(filepath.Join(na.stateDir, "cni-pods")))
		na.startAgent()
		na.waitAgent()
		note("node-a's agent restarted without its CNI reports, as on a first install")
		b.eventually("a1 found and redirected", func() error { return na.noBypass("a1") })
		b.setEnrolled(p.a3, true)
		b.knows(na, p.a3, p.b1, true)
		b.eventually("a3 found and redirected", func() error { return na.noBypass("a3") })
		if err := inPodInPlace(p.a3); err != nil {
			t.Error(err)
		}
		for _, from := range []*bedPod{p.a1, p.a3} {
			for _, v6 := range []bool{false, true} {
				f := b.run(from, p.b1, v6)
				report(f)
				expectMTLS(t, f)
			}
		}
		// What was found is kept as reports, for a restarted agent.
		kept, err := filepath.Glob(filepath.Join(na.stateDir, "cni-pods", "found-*.json"))
		must(t, err)
		if len(kept) != 2 {
			t.Errorf("kept reports of namespaces found: %q, want a1's and a3's", kept)
		}
	})
}

// expectPlainInPod: the payload arrived intact from the source pod's
// address, crossed the underlay in clear, through the source node's proxy
// only when the source is enrolled (outbound plain) and through the
// destination node's only when the destination is (inbound plain, 15006).
func expectPlainInPod(t *testing.T, f *flow, viaSource, viaDestination bool) {
	t.Helper()
	src := f.from.addr(f.dst.Addr().Is6())
	switch {
	case f.err != nil:
		t.Errorf("%s -> %s: %v", f.from, f.dst, f.err)
	case f.reply.server != f.to.name || f.reply.remote.Addr() != src:
		t.Errorf("%s -> %s: answered by %s from %s, want %s from %s", f.from, f.dst, f.reply.server, f.reply.remote, f.to.name, src)
	case !f.visible:
		t.Errorf("%s -> %s: plain payload not seen on the underlay", f.from, f.dst)
	case viaSource != (f.out != nil) || (f.out != nil && f.out["protocol"] != proxy.ProtocolPlain):
		t.Errorf("%s -> %s: source proxy's record %v, want one: %v", f.from, f.dst, f.out, viaSource)
	case viaDestination != (f.in != nil) || (f.in != nil && f.in["protocol"] != proxy.ProtocolPlain):
		t.Errorf("%s -> %s: destination proxy's record %v, want one: %v", f.from, f.dst, f.in, viaDestination)
	}
}

// inPodRulesPresent tells whether the pod's namespace holds the in-pod
// redirection's nftables table.
func inPodRulesPresent(t testing.TB, p *bedPod) bool {
	conn, err := nftables.New(nftables.WithNetNSFd(int(p.ns.Handle)))
	must(t, err)
	tbls, err := conn.ListTablesOfFamily(nftables.TableFamilyINet)
	must(t, err)
	return slices.ContainsFunc(tbls, func(tb *nftables.Table) bool { return tb.Name == inpod.NFTTableName })
}

// inPodInPlace checks in the pod's namespace, as a pod that starts would
// find it: the redirection's four chains, the policy rule of each family,
// and a listener of the proxy on each of ztunnel's ports.
func inPodInPlace(p *bedPod) error {
	conn, err := nftables.New(nftables.WithNetNSFd(int(p.ns.Handle)))
	if err != nil {
		return err
	}
	chains, err := conn.ListChainsOfTableFamily(nftables.TableFamilyINet)
	if err != nil {
		return err
	}
	n := 0
	for _, c := range chains {
		if c.Table.Name == inpod.NFTTableName {
			n++
		}
	}
	if n != 4 {
		return fmt.Errorf("%s: %d chains of %s in its namespace, want 4", p, n, inpod.NFTTableName)
	}
	h, err := netlink.NewHandleAt(p.ns.Handle, unix.NETLINK_ROUTE, unix.NETLINK_INET_DIAG)
	if err != nil {
		return err
	}
	defer h.Close()
	listening := map[uint16]bool{}
	for _, family := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
		rules, err := h.RuleList(family)
		if err != nil {
			return err
		}
		if !slices.ContainsFunc(rules, func(r netlink.Rule) bool { return r.Table == inpod.RouteTable && r.Mark == inpod.ConnMark }) {
			return fmt.Errorf("%s: no policy rule of family %d", p, family)
		}
		socks, err := h.SocketDiagTCP(uint8(family))
		if err != nil {
			return err
		}
		for _, s := range socks {
			if s.State == 10 { // TCP_LISTEN
				listening[s.ID.SourcePort] = true
			}
		}
	}
	for _, port := range []uint16{inpod.OutboundPort, inpod.InboundPlainPort, inpod.HBONEPort} {
		if !listening[port] {
			return fmt.Errorf("%s: no proxy listener on %d in its namespace", p, port)
		}
	}
	return nil
}

func sortedStrings(s []string) []string {
	s = slices.Clone(s)
	slices.Sort(s)
	return s
}
