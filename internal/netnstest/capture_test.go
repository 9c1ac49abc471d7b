// SPDX-License-Identifier: Apache-2.0

package netnstest_test

import (
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/mtlsbridge/mtlsbridge/internal/netnstest"
)

// TestCapture: a payload sent from one namespace to another over a veth
// pair is recorded on both ends, outgoing on the sender's.
func TestCapture(t *testing.T) {
	netnstest.RequirePrivileged(t)
	a, b := netnstest.NewNS(t, "mtlsb-capa"), netnstest.NewNS(t, "mtlsb-capb")
	must(t, a.Netlink(t).LinkAdd(&netlink.Veth{
		LinkAttrs:     netlink.LinkAttrs{Name: "va"},
		PeerName:      "vb",
		PeerNamespace: netlink.NsFd(b.Handle),
	}))
	addrs := map[*netnstest.NS][]netip.Prefix{
		a: {netip.MustParsePrefix("10.99.0.1/24"), netip.MustParsePrefix("fd00:99::1/64")},
		b: {netip.MustParsePrefix("10.99.0.2/24"), netip.MustParsePrefix("fd00:99::2/64")},
	}
	for ns, name := range map[*netnstest.NS]string{a: "va", b: "vb"} {
		h := ns.Netlink(t)
		l, err := h.LinkByName(name)
		must(t, err)
		for _, p := range addrs[ns] {
			must(t, h.AddrAdd(l, &netlink.Addr{
				IPNet: &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())},
				Flags: unix.IFA_F_NODAD,
			}))
		}
		must(t, h.LinkSetUp(l))
	}
	capA, capB := a.Capture(t, "va"), b.Capture(t, "vb")
	sent, never := []byte("through the veth"), []byte("never sent")
	capA.Watch(sent)
	capA.Watch(never)

	for i, dst := range []netip.Addr{addrs[b][0].Addr(), addrs[b][1].Addr()} {
		var l net.Listener
		must(t, b.Do(func() (err error) {
			l, err = net.Listen("tcp", netip.AddrPortFrom(dst, 0).String())
			return err
		}))
		defer l.Close()
		received := make(chan string, 1)
		go func() {
			c, err := l.Accept()
			if err != nil {
				received <- err.Error()
				return
			}
			defer c.Close()
			c.SetDeadline(time.Now().Add(netnstest.DialTimeout))
			got, _ := io.ReadAll(c)
			received <- string(got)
		}()

		var c net.Conn
		must(t, a.Do(func() (err error) {
			c, err = net.DialTimeout("tcp", l.Addr().String(), netnstest.DialTimeout)
			return err
		}))
		const msg = "hello through the veth"
		_, err := io.WriteString(c, msg)
		c.Close()
		must(t, err)
		if got := <-received; got != msg {
			t.Fatalf("%s: server got %q", dst, got)
		}

		from := c.LocalAddr().(*net.TCPAddr).AddrPort()
		to := l.Addr().(*net.TCPAddr).AddrPort()
		from = netip.AddrPortFrom(from.Addr().Unmap(), from.Port())
		to = netip.AddrPortFrom(to.Addr().Unmap(), to.Port())
		for _, side := range []struct {
			c        *netnstest.Capture
			outgoing bool
		}{{capA, true}, {capB, false}} {
			waitSegment(t, side.c, func(s netnstest.Segment) bool {
				return s.Src == from && s.Dst == to && s.Payload > 0 && s.Outgoing == side.outgoing
			})
			waitSegment(t, side.c, func(s netnstest.Segment) bool {
				return s.Src == from && s.Dst == to && s.SYN && !s.ACK && s.Outgoing == side.outgoing
			})
		}
		// The payload is recognised, its head kept; what was not sent is
		// not seen.
		if seen := capA.Seen(sent); len(seen) == 0 || string(seen[0].Head) != msg[:netnstest.HeadSize] {
			t.Errorf("marker of the payload seen in %v", seen)
		}
		if seen := capA.Seen(never); len(seen) != 0 {
			t.Errorf("a marker never sent seen in %v", seen)
		}
		if i == 0 {
			t.Logf("segments on va:")
			for _, s := range capA.Segments() {
				t.Logf("  %s", s)
			}
		}
	}

	capA.Close()
	capA.Close() // idempotent
	if err := capA.Err(); err != nil {
		t.Fatal(err)
	}
	if capA.Dropped() != 0 {
		t.Fatalf("dropped %d", capA.Dropped())
	}
}

// waitSegment waits, a bounded time, for a segment matching ok.
func waitSegment(t *testing.T, c *netnstest.Capture, ok func(netnstest.Segment) bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		segs := c.Segments()
		for _, s := range segs {
			if ok(s) {
				return
			}
		}
		if time.Now().After(deadline) {
			for _, s := range segs {
				t.Logf("  %s", s)
			}
			t.Fatalf("no such segment among %d captured", len(segs))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
