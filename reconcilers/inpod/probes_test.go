// SPDX-License-Identifier: Apache-2.0

package inpod

import (
	"errors"
	"net/netip"
	"strings"
	"syscall"
	"testing"

	"github.com/google/nftables"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/mtlsbridge/mtlsbridge/internal/netnstest"
)

// TestProbeSNAT writes the node's SNAT of probes into a real node and
// sends real TCP through it: the pod has the in-pod redirection and no
// ztunnel listener, so a connection reaches the pod's port only past the
// redirection. The node's own connections to it do, from the probe
// address; a pod's, which the node forwards, and a transparent socket's of
// the node in another's name, do not (refused, fail closed); the node's
// connections to a pod not in the set keep their source. Then the table is
// altered, written again, and removed.
func TestProbeSNAT(t *testing.T) {
	netnstest.RequirePrivileged(t)
	node, _ := netnstest.NewNodes(t)
	a := node.AddPod(t, "a")
	b := node.AddPod(t, "b")
	plain := node.AddPod(t, "plain")
	for _, p := range []*netnstest.Pod{a, plain} {
		p.Serve(t, p.Name, 8080, false, p.IP4, p.IP6)
	}
	must(t, applyRules(a.Handle, families{v4: true, v6: true}))
	conn, err := nftables.New(nftables.WithNetNSFd(int(node.Handle)))
	must(t, err)
	ips := []netip.Addr{a.IP4, a.IP6}
	must(t, writeProbeSNAT(conn, ips))
	// Writing again (an agent restart) replaces, never duplicates.
	must(t, writeProbeSNAT(conn, ips))
	if gaps, err := checkProbeSNAT(conn, ips); err != nil || len(gaps) > 0 {
		t.Fatalf("right after writing: %v %v", gaps, err)
	}

	for i, probe := range []netip.Addr{ProbeSNAT4, ProbeSNAT6} {
		dst := netip.AddrPortFrom(ips[i], 8080)
		if got, err := node.Ask(dst); err != nil || got.Server != "a" || got.Remote.Addr() != probe {
			t.Errorf("node -> %s: %v %v, want a, from %s", dst, got, err, probe)
		}
		if got, err := b.Ask(dst); !errors.Is(err, syscall.ECONNREFUSED) {
			t.Errorf("b -> %s through the node: %v %v, want refused (no ztunnel listener)", dst, got, err)
		}
		plainDst := netip.AddrPortFrom([]netip.Addr{plain.IP4, plain.IP6}[i], 8080)
		if got, err := node.Ask(plainDst); err != nil || got.Remote.Addr() == probe {
			t.Errorf("node -> %s (not in the set): %v %v, want the node's own source", plainDst, got, err)
		}
	}

	// A transparent socket of the node speaking for b (as an L7 proxy
	// connects in a client's name) has no local source: not SNATed, a's
	// redirection takes it (refused). What a sends to b's address is
	// delivered to the node, as a transparent proxy routes it, so that a
	// wrong SNAT would show as an answer.
	nl := node.Netlink(t)
	toB := netlink.NewRule()
	toB.Dst, toB.IifName, toB.Table, toB.Priority = netnstest.HostPrefix(b.IP4), a.HostIf, 200, 100
	must(t, nl.RuleAdd(toB))
	must(t, nl.RouteAdd(&netlink.Route{Dst: netnstest.HostPrefix(b.IP4), LinkIndex: 1, Table: 200, Type: unix.RTN_LOCAL, Scope: netlink.SCOPE_HOST}))
	if got, err := node.AskFrom(netip.AddrPortFrom(b.IP4, 0), netip.AddrPortFrom(a.IP4, 8080)); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Errorf("node as b -> a (transparent): %v %v, want refused (not SNATed)", got, err)
	}

	// A set emptied by hand is seen and written again.
	set, err := conn.GetSetByName(&nftables.Table{Name: ProbeTableName, Family: nftables.TableFamilyINet}, probeSetV4)
	must(t, err)
	must(t, conn.SetDeleteElements(set, []nftables.SetElement{{Key: a.IP4.AsSlice()}}))
	must(t, conn.Flush())
	gaps, err := checkProbeSNAT(conn, ips)
	if err != nil || len(gaps) != 1 || !strings.HasPrefix(gaps[0], GapProbesAltered+": set "+probeSetV4) {
		t.Errorf("after deleting an element: %q %v, want the v4 set altered", gaps, err)
	}
	if got, err := node.Ask(netip.AddrPortFrom(a.IP4, 8080)); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Errorf("node -> a without its element: %v %v, want refused", got, err)
	}
	must(t, writeProbeSNAT(conn, ips))
	if got, err := node.Ask(netip.AddrPortFrom(a.IP4, 8080)); err != nil || got.Remote.Addr() != ProbeSNAT4 {
		t.Errorf("node -> a written again: %v %v", got, err)
	}

	// A table deleted by hand (Istio #60607's flush) is seen and written
	// again.
	must(t, deleteTable(conn, &nftables.Table{Name: ProbeTableName, Family: nftables.TableFamilyINet}))
	if gaps, err := checkProbeSNAT(conn, ips); err != nil || len(gaps) != 1 || gaps[0] != gapProbesMissing {
		t.Errorf("after deleting the table: %q %v, want %q", gaps, err, gapProbesMissing)
	}
	must(t, writeProbeSNAT(conn, ips))
	if gaps, err := checkProbeSNAT(conn, ips); err != nil || len(gaps) > 0 {
		t.Errorf("written again: %v %v", gaps, err)
	}

	// No pod left: the table goes.
	must(t, writeProbeSNAT(conn, nil))
	if exists, err := tableExists(conn, ProbeTableName); err != nil || exists {
		t.Errorf("without pods the table exists: %v %v", exists, err)
	}
	if gaps, err := checkProbeSNAT(conn, nil); err != nil || len(gaps) > 0 {
		t.Errorf("removed: %v %v", gaps, err)
	}
}
