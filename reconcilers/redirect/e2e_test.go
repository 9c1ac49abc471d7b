// SPDX-License-Identifier: Apache-2.0

package redirect_test

import (
	"net"
	"net/netip"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/mtlsbridge/mtlsbridge/bpf"
	"github.com/mtlsbridge/mtlsbridge/internal/netnstest"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/redirect"
)

// TestRedirect runs the agent for node-a on two nodes made of network
// namespaces and checks where TCP ends up: at the pod it was sent to, or
// at node-a's mTLS agent with its original destination.
func TestRedirect(t *testing.T) {
	c := newCluster(t)
	c.write(t, manifest{enrollA: true, withAgent: true})
	ag := c.startAgent(t)
	done := reconciler.StatusKindDone
	ag.waitFor(t, "a's entries, the agent's and the attachments", func(txn statedb.ReadTxn) bool {
		return ag.redirectIs(txn, c.a.IP4, bpf.KindEnrolled, done) && ag.redirectIs(txn, c.a.IP6, bpf.KindEnrolled, done) &&
			ag.redirectIs(txn, bpf.AgentKey, bpf.KindAgent, done) &&
			ag.attachmentIs(txn, c.a.HostIf, done) && ag.attachmentIs(txn, netnstest.UplinkName, done)
	})

	t.Run("enrolled pod to another node goes to the agent", func(t *testing.T) {
		for _, dst := range []netip.Addr{c.r.IP4, c.r.IP6} {
			ans := ask(t, c.a, dst, 8080)
			src := c.a.IP4
			if dst.Is6() {
				src = c.a.IP6
			}
			if ans.Server != "agent" || ans.Local != netip.AddrPortFrom(dst, 8080) || ans.Remote.Addr() != src {
				t.Errorf("a -> %s answered by %s, want the agent, with the original destination and source", dst, ans)
			}
		}
	})
	t.Run("pod not enrolled to another node is not steered", func(t *testing.T) {
		for _, dst := range []netip.Addr{c.r.IP4, c.r.IP6} {
			if ans := ask(t, c.n, dst, 8080); ans.Server != "r" {
				t.Errorf("n -> %s answered by %s, want r", dst, ans)
			}
		}
	})
	t.Run("same-node traffic is not steered", func(t *testing.T) {
		for _, dst := range []netip.Addr{c.n.IP4, c.n.IP6} {
			if ans := ask(t, c.a, dst, 8080); ans.Server != "n" {
				t.Errorf("a -> %s answered by %s, want n", dst, ans)
			}
		}
	})
	t.Run("HBONE to a local enrolled pod goes to the agent", func(t *testing.T) {
		for _, dst := range []netip.Addr{c.a.IP4, c.a.IP6} {
			ans := ask(t, c.r, dst, 15008)
			if ans.Server != "agent" || ans.Local != netip.AddrPortFrom(dst, 15008) {
				t.Errorf("r -> %s:15008 answered by %s, want the agent with the original destination", dst, ans)
			}
		}
	})
	t.Run("HBONE to a pod not enrolled, plaintext to an enrolled pod: not steered", func(t *testing.T) {
		if ans := ask(t, c.r, c.n.IP4, 15008); ans.Server != "n" {
			t.Errorf("r -> n:15008 answered by %s, want n", ans)
		}
		if ans := ask(t, c.r, c.a.IP4, 8080); ans.Server != "a" {
			t.Errorf("r -> a:8080 answered by %s, want a", ans)
		}
	})
	t.Run("replies to the agent's connections in a pod's name reach the agent", func(t *testing.T) {
		// Without node-ingress steering the reply would reach pod a, which
		// knows no such connection: the connect would fail.
		for _, p := range []struct{ src, dst netip.Addr }{{c.a.IP4, c.r.IP4}, {c.a.IP6, c.r.IP6}} {
			ans, err := c.agent.AskFrom(netip.AddrPortFrom(p.src, 0), netip.AddrPortFrom(p.dst, 8080))
			if err != nil {
				t.Fatalf("agent as %s -> %s: %v", p.src, p.dst, err)
			}
			if ans.Server != "r" || ans.Remote.Addr() != p.src {
				t.Errorf("agent as %s -> %s answered by %s, want r seeing %s", p.src, p.dst, ans, p.src)
			}
		}
	})
	t.Run("a pod taking an enrolled pod's address does not take its steering", func(t *testing.T) {
		// Pod n (NET_ADMIN) puts a's addresses on its own eth0. A scan
		// that believed n would move a's entries and program to n's
		// interface, and a's TCP would leave unsteered.
		h := c.n.Netlink(t)
		eth0, err := h.LinkByName("eth0")
		must(t, err)
		claims := []*netlink.Addr{
			{IPNet: &net.IPNet{IP: c.a.IP4.AsSlice(), Mask: net.CIDRMask(32, 32)}},
			{IPNet: &net.IPNet{IP: c.a.IP6.AsSlice(), Mask: net.CIDRMask(128, 128)}, Flags: unix.IFA_F_NODAD},
		}
		for _, claim := range claims {
			must(t, h.AddrAdd(eth0, claim))
		}
		ag.waitFor(t, "a's IPv4 row saying the address is claimed twice", func(txn statedb.ReadTxn) bool {
			r, _, ok := ag.redirects.Get(txn, redirect.RedirectByAddr(c.a.IP4))
			return ok && strings.Contains(r.Status.GetError(), redirect.ErrAmbiguousInterface.Error())
		})
		pinned, err := ebpf.LoadPinnedMap(filepath.Join(c.bpfRoot, "agent", bpf.MapName), &ebpf.LoadPinOptions{ReadOnly: true})
		must(t, err)
		defer pinned.Close()
		entries, err := bpf.NewRedirectMap(pinned).Dump()
		must(t, err)
		if e := entries[c.a.IP4]; e.Kind != bpf.KindEnrolled || int(e.Ifindex) != c.a.HostIndex {
			t.Errorf("a's IPv4 entry %v, want enrolled on a's interface %d", e, c.a.HostIndex)
		}
		if !ag.attachmentIs(ag.db.ReadTxn(), c.a.HostIf, done) {
			t.Errorf("a's interface lost its program:\n%s", ag.dump(ag.db.ReadTxn()))
		}
		if ans := ask(t, c.a, c.r.IP4, 8080); ans.Server != "agent" {
			t.Errorf("a -> %s answered by %s, want the agent", c.r.IP4, ans)
		}
		for _, claim := range claims {
			must(t, h.AddrDel(eth0, claim))
		}
		ag.waitFor(t, "a's IPv4 row done again", func(txn statedb.ReadTxn) bool {
			return ag.redirectIs(txn, c.a.IP4, bpf.KindEnrolled, done)
		})
	})
	t.Run("a pod without interface shows why, and nothing else suffers", func(t *testing.T) {
		r, _, ok := ag.redirects.Get(ag.db.ReadTxn(), redirect.RedirectByAddr(ghostIP))
		if !ok || r.Status.Kind != reconciler.StatusKindError || !strings.Contains(r.Status.GetError(), redirect.ErrNoInterface.Error()) {
			t.Errorf("ghost's row: %v", r)
		}
	})

	// Removing the enrollment removes the redirect.
	c.write(t, manifest{enrollA: false, withAgent: true})
	ag.waitFor(t, "a's entries local, its attachment gone", func(txn statedb.ReadTxn) bool {
		_, _, attached := ag.attachments.Get(txn, redirect.AttachmentByDevice(c.a.HostIf))
		return ag.redirectIs(txn, c.a.IP4, bpf.KindLocal, done) && ag.redirectIs(txn, c.a.IP6, bpf.KindLocal, done) && !attached
	})
	for _, dst := range []netip.Addr{c.r.IP4, c.r.IP6} {
		if ans := ask(t, c.a, dst, 8080); ans.Server != "r" {
			t.Errorf("after unenrolling, a -> %s answered by %s, want r", dst, ans)
		}
	}
	if ans := ask(t, c.r, c.a.IP4, 15008); ans.Server != "a" {
		t.Errorf("after unenrolling, r -> a:15008 answered by %s, want a", ans)
	}
}
