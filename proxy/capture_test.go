// SPDX-License-Identifier: Apache-2.0

package proxy_test

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/nftables"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/mtlsbridge/mtlsbridge/internal/netnstest"
	"github.com/mtlsbridge/mtlsbridge/proxy"
)

// TestCapture: in the proxy's namespace (node 1 of a netnstest pair, its
// uplink standing for the proxy pod's eth0), TCP that arrives for
// addresses the namespace does not have reaches the loopback listeners
// with the original destination as local address: port 15008 the HBONE
// listener, any other port the outbound one, over IPv4 and IPv6. Traffic
// to the namespace's own address is left alone. A transparent connection
// made in another address's name gets its replies. Installing twice
// replaces the first capture; Remove leaves nothing; without listeners
// the captured packets go nowhere.
func TestCapture(t *testing.T) {
	netnstest.RequirePrivileged(t)
	px, peer := netnstest.NewNodes(t)
	// A proxy's namespace does not forward: what the capture does not take
	// is dropped, never passed on.
	px.Sysctl(t, "ipv4/ip_forward", "0")
	px.Sysctl(t, "ipv6/conf/all/forwarding", "0")
	opts := proxy.CaptureOptions{Netns: px.Handle, Interface: netnstest.UplinkName}

	outbound := listenIn(t, px, []string{"127.0.0.1:15001", "[::1]:15001"})
	hbone := listenIn(t, px, []string{"127.0.0.1:15008", "[::1]:15008"})
	px.Serve(t, "own", 15021, false, px.Addr4, px.Addr6)
	// The peer's server, answering connections made from the proxy in a
	// pod's name.
	peer.Serve(t, "peer", 9090, false, peer.Addr4, peer.Addr6)

	var c *proxy.Capture
	for range 2 { // the second install replaces the first
		var err error
		c, err = proxy.InstallCapture(opts)
		if err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() { c.Remove() })
	if n := countRules(t, px); n != 6 {
		t.Fatalf("%d prerouting rules after two installs, want the 6 of one", n)
	}

	// Pod ranges of node 1 (10.1.0.0/24, fd00:1::/64) are routed to px by
	// the peer, and px has none of their addresses.
	for _, dst := range []netip.Addr{netip.MustParseAddr("10.1.0.77"), netip.MustParseAddr("fd00:1::77")} {
		for _, tc := range []struct {
			port uint16
			want chan net.Conn
		}{{8080, outbound}, {15008, hbone}} {
			target := netip.AddrPortFrom(dst, tc.port)
			go peer.Ask(target) // answered by nobody: the test reads the accept
			select {
			case conn := <-tc.want:
				if got := conn.LocalAddr().(*net.TCPAddr).AddrPort(); got.Addr().Unmap() != dst || got.Port() != tc.port {
					t.Errorf("connection to %s accepted with local address %s", target, got)
				}
				conn.Close()
			case <-time.After(5 * time.Second):
				t.Fatalf("connection to %s not captured", target)
			}
		}
	}
	// The namespace's own address is not captured.
	for _, own := range []netip.Addr{px.Addr4, px.Addr6} {
		ans, err := peer.Ask(netip.AddrPortFrom(own, 15021))
		if err != nil || ans.Server != "own" {
			t.Errorf("own address %s: %v %v", own, ans, err)
		}
	}
	// A connection made from px in the name of 10.1.0.88 (as the proxy
	// does for a pod) gets its answer back through the capture.
	for _, c := range []struct{ from, to netip.Addr }{
		{netip.MustParseAddr("10.1.0.88"), peer.Addr4}, {netip.MustParseAddr("fd00:1::88"), peer.Addr6},
	} {
		ans, err := px.AskFrom(netip.AddrPortFrom(c.from, 0), netip.AddrPortFrom(c.to, 9090))
		if err != nil || ans.Server != "peer" || ans.Remote.Addr() != c.from {
			t.Errorf("transparent connection from %s: %v %v", c.from, ans, err)
		}
	}

	// Removed: no table, rule or route left behind.
	if err := c.Remove(); err != nil {
		t.Fatal(err)
	}
	if n := countRules(t, px); n != 0 {
		t.Errorf("%d rules left after Remove", n)
	}
	h := px.Netlink(t)
	for _, family := range []int{unix.AF_INET, unix.AF_INET6} {
		rules, err := h.RuleList(family)
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range rules {
			if r.Table == proxy.DefaultRouteTable {
				t.Errorf("rule left: %s", r)
			}
		}
		routes, err := h.RouteListFiltered(family, &netlink.Route{Table: proxy.DefaultRouteTable}, netlink.RT_FILTER_TABLE)
		if err != nil {
			t.Fatal(err)
		}
		if len(routes) != 0 {
			t.Errorf("routes left in table %d: %v", proxy.DefaultRouteTable, routes)
		}
	}
	// Without capture, nothing reaches the listeners: px does not forward.
	if _, err := peer.Ask(netip.MustParseAddrPort("10.1.0.77:8080")); err == nil {
		t.Error("connection to 10.1.0.77 answered without capture")
	}
	select {
	case conn := <-outbound:
		t.Errorf("accepted %s without capture", conn.LocalAddr())
	default:
	}
}

// TestCaptureFailsClosed: with the capture in place but no proxy listening
// (a killed proxy), captured connections fail, even though the namespace
// forwards (netnstest's nodes do): nothing passes through.
func TestCaptureFailsClosed(t *testing.T) {
	netnstest.RequirePrivileged(t)
	px, peer := netnstest.NewNodes(t)
	// A server where the captured packets would go if forwarded: px
	// routes 10.1.0.0/24 nowhere, so give it one on a pod of its own.
	pod := px.AddPod(t, "target")
	pod.Serve(t, "leaked", 8080, false, pod.IP4, pod.IP6)
	if ans, err := peer.Ask(netip.AddrPortFrom(pod.IP4, 8080)); err != nil || ans.Server != "leaked" {
		t.Fatalf("without capture, the pod behind px answers: %v %v", ans, err)
	}
	c, err := proxy.InstallCapture(proxy.CaptureOptions{Netns: px.Handle, Interface: netnstest.UplinkName})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Remove() })
	var wg sync.WaitGroup
	for _, target := range []netip.AddrPort{netip.AddrPortFrom(pod.IP4, 8080), netip.AddrPortFrom(pod.IP6, 8080),
		netip.AddrPortFrom(pod.IP4, 15008)} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if ans, err := peer.Ask(target); err == nil {
				t.Errorf("%s answered without a proxy: %s", target, ans)
			}
		}()
	}
	wg.Wait()
}

// listenIn opens transparent listeners in the namespace and passes every
// accepted connection on.
func listenIn(t *testing.T, ns *netnstest.Node, addrs []string) chan net.Conn {
	accepted := make(chan net.Conn, 16)
	for _, a := range addrs {
		var l net.Listener
		err := ns.Do(func() (err error) {
			lc := net.ListenConfig{Control: func(network, _ string, c syscall.RawConn) error {
				var serr error
				c.Control(func(fd uintptr) {
					if strings.HasSuffix(network, "6") {
						serr = unix.SetsockoptInt(int(fd), unix.SOL_IPV6, unix.IPV6_TRANSPARENT, 1)
					} else {
						serr = unix.SetsockoptInt(int(fd), unix.SOL_IP, unix.IP_TRANSPARENT, 1)
					}
				})
				return serr
			}}
			network := "tcp4"
			if strings.HasPrefix(a, "[") {
				network = "tcp6"
			}
			l, err = lc.Listen(context.Background(), network, a)
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close() })
		go func() {
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				accepted <- c
			}
		}()
	}
	return accepted
}

// countRules counts the rules of the capture's table in the namespace.
func countRules(t *testing.T, ns *netnstest.Node) int {
	conn, err := nftables.New(nftables.WithNetNSFd(int(ns.Handle)))
	if err != nil {
		t.Fatal(err)
	}
	table := &nftables.Table{Name: proxy.DefaultCaptureTable, Family: nftables.TableFamilyINet}
	rules, err := conn.GetRules(table, &nftables.Chain{Name: "prerouting", Table: table})
	if err != nil {
		if strings.Contains(err.Error(), "no such file") || strings.Contains(err.Error(), "not found") {
			return 0
		}
		t.Fatal(fmt.Errorf("list rules: %w", err))
	}
	return len(rules)
}
