// SPDX-License-Identifier: Apache-2.0

package inpod

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/google/nftables"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/mtlsbridge/mtlsbridge/internal/netnstest"
)

// TestRulesRedirect writes the redirection into a real pod's namespace and
// sends real TCP through it, as ztunnel and the pod's peers would: the
// pod's outbound TCP reaches ztunnel's 15001 with its original
// destination, plain inbound reaches 15006, HBONE reaches 15008, ztunnel's
// own marked sockets pass, its transparent connection to the pod gets the
// pod's replies back through table 100, and without a listener the pod's
// connection is refused (fail closed). Then the rules are altered and
// removed, and the check sees each change.
func TestRulesRedirect(t *testing.T) {
	netnstest.RequirePrivileged(t)
	n1, n2 := netnstest.NewNodes(t)
	a := n1.AddPod(t, "a")
	r := n2.AddPod(t, "r")
	a.Serve(t, "app", 8080, false, a.IP4, a.IP6)
	r.Serve(t, "r", 8080, false, r.IP4, r.IP6)
	fam := families{v4: true, v6: true}
	must(t, applyRules(a.Handle, fam))
	// Applying again (an agent restart) replaces, never duplicates.
	must(t, applyRules(a.Handle, fam))
	if gaps, err := checkRules(a.Handle, fam); err != nil || len(gaps) > 0 {
		t.Fatalf("right after applying: %v %v", gaps, err)
	}

	// ztunnel's listeners inside the pod, answering with their name and
	// the connection's original destination.
	outbound := listen(t, a, OutboundPort, "outbound")
	listen(t, a, InboundPlainPort, "inbound-plain")
	listen(t, a, HBONEPort, "hbone")

	for _, v6 := range []bool{false, true} {
		ipA, ipR := a.IP4, r.IP4
		if v6 {
			ipA, ipR = a.IP6, r.IP6
		}
		t.Run(fmt.Sprintf("v6=%v", v6), func(t *testing.T) {
			expect := func(what, got string, err error, want string) {
				t.Helper()
				if err != nil || !strings.HasPrefix(got, want) {
					t.Errorf("%s: %q %v, want %q", what, got, err, want)
				}
			}
			got, err := ask(a, netip.AddrPort{}, netip.AddrPortFrom(ipR, 8080), 0)
			expect("pod -> peer", got, err, "outbound "+netip.AddrPortFrom(ipR, 8080).String())
			got, err = ask(r, netip.AddrPort{}, netip.AddrPortFrom(ipA, 8080), 0)
			expect("peer -> pod", got, err, "inbound-plain "+netip.AddrPortFrom(ipA, 8080).String())
			got, err = ask(r, netip.AddrPort{}, netip.AddrPortFrom(ipA, HBONEPort), 0)
			expect("peer -> pod:15008", got, err, "hbone")
			got, err = ask(a, netip.AddrPort{}, netip.AddrPortFrom(ipR, 8080), ZtunnelMark)
			expect("ztunnel's own socket -> peer", got, err, "r ")
			got, err = ask(a, netip.AddrPort{}, netip.AddrPortFrom(ipA, 8080), 0)
			expect("pod -> itself", got, err, "app ")
			// ztunnel delivering a peer's connection to the pod: from the
			// peer's address, inside the pod; the pod sees the peer, and its
			// replies come back to ztunnel instead of leaving.
			got, err = ask(a, netip.AddrPortFrom(ipR, 0), netip.AddrPortFrom(ipA, 8080), ZtunnelMark)
			peer := strings.TrimSuffix(netip.AddrPortFrom(ipR, 0).String(), ":0") + ":"
			expect("ztunnel -> pod in the peer's name", got, err, "app "+netip.AddrPortFrom(ipA, 8080).String()+" "+peer)
		})
	}

	// No ztunnel listener: refused inside the pod, nothing reaches r.
	outbound.Close()
	_, err := ask(a, netip.AddrPort{}, netip.AddrPortFrom(r.IP4, 8080), 0)
	if !errors.Is(err, syscall.ECONNREFUSED) {
		t.Errorf("without ztunnel, pod -> peer: %v, want connection refused", err)
	}

	// Altered, then partly removed: the check names each gap.
	conn, err := nftables.New(nftables.WithNetNSFd(int(a.Handle)))
	must(t, err)
	table := &nftables.Table{Name: NFTTableName, Family: nftables.TableFamilyINet}
	rules, err := conn.GetRules(table, &nftables.Chain{Name: chainOutputNAT, Table: table})
	must(t, err)
	must(t, conn.DelRule(rules[len(rules)-2])) // the IPv4 redirect to 15001
	must(t, conn.Flush())
	h := a.Netlink(t)
	must(t, h.RuleDel(policyRule(unix.AF_INET6)))
	gaps, err := checkRules(a.Handle, fam)
	must(t, err)
	if want := []string{GapTableAltered + ": chain output-nat has 6 rules, want 7", GapRuleMissing + " (IPv6)"}; strings.Join(gaps, "|") != strings.Join(want, "|") {
		t.Errorf("gaps %q, want %q", gaps, want)
	}
	if _, err := ask(a, netip.AddrPort{}, netip.AddrPortFrom(r.IP4, 8080), 0); err != nil {
		t.Errorf("with the redirect rule deleted by hand the pod's TCP leaves directly (what the check reports): %v", err)
	}

	// Removed: nothing is left, and removing again is fine.
	must(t, removeRules(a.Handle))
	must(t, removeRules(a.Handle))
	if present, err := rulesPresent(a.Handle); err != nil || present {
		t.Errorf("after removal: present %v, %v", present, err)
	}
	gaps, err = checkRules(a.Handle, fam)
	must(t, err)
	if !strings.HasPrefix(strings.Join(gaps, "|"), GapTableMissing+"|"+GapRuleMissing) {
		t.Errorf("after removal the check says %q", gaps)
	}
	for _, family := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
		routes, err := h.RouteListFiltered(family, &netlink.Route{Table: RouteTable}, netlink.RT_FILTER_TABLE)
		must(t, err)
		if len(routes) > 0 {
			t.Errorf("routes left in table %d: %v", RouteTable, routes)
		}
	}
	got, err := ask(a, netip.AddrPort{}, netip.AddrPortFrom(r.IP4, 8080), 0)
	if err != nil || !strings.HasPrefix(got, "r ") {
		t.Errorf("after removal, pod -> peer: %q %v, want r directly", got, err)
	}
}

// TestPodNetnsChecks: only a namespace that is a pod's, holding its
// addresses, is used.
func TestPodNetnsChecks(t *testing.T) {
	netnstest.RequirePrivileged(t)
	n1, _ := netnstest.NewNodes(t)
	a := n1.AddPod(t, "a")
	path := "/var/run/netns/" + a.NS.Name
	f, err := openPodNetns(path, []netip.Addr{a.IP4, a.IP6})
	must(t, err)
	f.Close()
	if _, err := openPodNetns(path, []netip.Addr{netip.MustParseAddr("10.9.9.9")}); !errors.Is(err, ErrWrongNetns) {
		t.Errorf("another pod's address: %v", err)
	}
	if _, err := openPodNetns("/proc/self/ns/net", nil); !errors.Is(err, ErrNodeNetns) {
		t.Errorf("the agent's own namespace: %v", err)
	}
	if _, err := openPodNetns("/proc/self/ns/uts", nil); err == nil {
		t.Error("a UTS namespace accepted")
	}
	if _, err := openPodNetns("/var/run/netns/none-such", nil); err == nil || !errors.Is(err, syscall.ENOENT) {
		t.Errorf("a missing namespace: %v", err)
	}
}

// TestPodNetnsWhileTheMainThreadIsThere: a library that opens a netlink
// socket in a pod's namespace (netlink.NewHandleAt, nftables) moves its
// thread there for a moment, and that may be the main thread, the one
// /proc/self names. Meanwhile the pod's namespace is still taken for a
// pod's, and the agent's own is still refused.
func TestPodNetnsWhileTheMainThreadIsThere(t *testing.T) {
	netnstest.RequirePrivileged(t)
	n1, _ := netnstest.NewNodes(t)
	a := n1.AddPod(t, "a")
	entered, leave := make(chan error), make(chan struct{})
	left := make(chan error, 1)
	mainThread <- func() {
		orig, err := netns.Get()
		if err == nil {
			err = netns.Set(a.Handle)
		}
		entered <- err
		if err != nil {
			return
		}
		<-leave
		left <- netns.Set(orig)
		orig.Close()
	}
	must(t, <-entered)
	defer func() {
		close(leave)
		must(t, <-left)
	}()
	// This goroutine is not on the main thread (TestMain keeps it), so
	// /proc/thread-self below is the test's own namespace.
	f, err := openPodNetns("/var/run/netns/"+a.NS.Name, []netip.Addr{a.IP4, a.IP6})
	if err != nil {
		t.Errorf("the pod's namespace while the main thread is in it: %v", err)
	} else {
		f.Close()
	}
	if _, err := openPodNetns("/proc/thread-self/ns/net", nil); !errors.Is(err, ErrNodeNetns) {
		t.Errorf("the agent's own namespace while the main thread is in a pod's: %v", err)
	}
}

// listen opens a listener of ztunnel's in the pod on both families,
// answering "NAME ORIGINAL-DESTINATION".
func listen(t *testing.T, p *netnstest.Pod, port int, name string) net.Listener {
	var ls []net.Listener
	for _, addr := range []string{fmt.Sprintf("0.0.0.0:%d", port), fmt.Sprintf("[::]:%d", port)} {
		network := "tcp4"
		if strings.HasPrefix(addr, "[") {
			network = "tcp6"
		}
		var l net.Listener
		must(t, p.Do(func() (err error) {
			l, err = net.Listen(network, addr)
			return err
		}))
		t.Cleanup(func() { l.Close() })
		ls = append(ls, l)
		go func() {
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				dst, err := originalDst(c.(*net.TCPConn))
				if err != nil {
					dst = addrPort(c.LocalAddr())
				}
				fmt.Fprintf(c, "%s %s\n", name, dst)
				c.Close()
			}
		}()
	}
	return multiCloser(ls)
}

type multiCloser []net.Listener

func (m multiCloser) Accept() (net.Conn, error) { return nil, errors.New("not for accepting") }
func (m multiCloser) Addr() net.Addr            { return m[0].Addr() }
func (m multiCloser) Close() error {
	for _, l := range m {
		l.Close()
	}
	return nil
}

// ask connects from the namespace (from local when valid, transparently;
// with mark when not 0) and returns the first line answered.
func ask(ns interface{ Do(func() error) error }, local, dst netip.AddrPort, mark int) (string, error) {
	d := net.Dialer{Timeout: 2 * time.Second, Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		err := c.Control(func(fd uintptr) {
			if mark != 0 {
				serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK, mark)
			}
			if serr == nil && local.IsValid() {
				if local.Addr().Is6() {
					serr = unix.SetsockoptInt(int(fd), unix.SOL_IPV6, unix.IPV6_TRANSPARENT, 1)
				} else {
					serr = unix.SetsockoptInt(int(fd), unix.SOL_IP, unix.IP_TRANSPARENT, 1)
				}
			}
		})
		return errors.Join(err, serr)
	}}
	if local.IsValid() {
		d.LocalAddr = net.TCPAddrFromAddrPort(local)
	}
	var c net.Conn
	err := ns.Do(func() (err error) {
		c, err = d.DialContext(context.Background(), "tcp", dst.String())
		return err
	})
	if err != nil {
		return "", err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(2 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	return strings.TrimSpace(line), err
}

// originalDst reads the destination a connection had before REDIRECT.
func originalDst(c *net.TCPConn) (netip.AddrPort, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return netip.AddrPort{}, err
	}
	var out netip.AddrPort
	var serr error
	err = rc.Control(func(fd uintptr) {
		if addrPort(c.LocalAddr()).Addr().Is4() {
			var sa unix.RawSockaddrInet4
			l := uint32(unsafe.Sizeof(sa))
			_, _, e := unix.Syscall6(unix.SYS_GETSOCKOPT, fd, unix.SOL_IP, 80, uintptr(unsafe.Pointer(&sa)), uintptr(unsafe.Pointer(&l)), 0)
			if e != 0 {
				serr = e
				return
			}
			out = netip.AddrPortFrom(netip.AddrFrom4(sa.Addr), uint16(sa.Port>>8|sa.Port<<8))
			return
		}
		var sa unix.RawSockaddrInet6
		l := uint32(unsafe.Sizeof(sa))
		_, _, e := unix.Syscall6(unix.SYS_GETSOCKOPT, fd, unix.SOL_IPV6, 80, uintptr(unsafe.Pointer(&sa)), uintptr(unsafe.Pointer(&l)), 0)
		if e != 0 {
			serr = e
			return
		}
		out = netip.AddrPortFrom(netip.AddrFrom16(sa.Addr), uint16(sa.Port>>8|sa.Port<<8))
	})
	return out, errors.Join(err, serr)
}

func addrPort(a net.Addr) netip.AddrPort {
	ap := a.(*net.TCPAddr).AddrPort()
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// The listener check finds ztunnel's listeners in either family and only
// listeners: a connection whose own port is one of ztunnel's does not
// count.
func TestListenersCheck(t *testing.T) {
	netnstest.RequirePrivileged(t)
	ns := netnstest.NewNS(t, "listeners")
	gaps := func() []string {
		t.Helper()
		gaps, err := checkListeners(ns.Handle)
		must(t, err)
		return gaps
	}
	noListener := func(port int) string { return fmt.Sprintf("%s %d", GapNoListener, port) }
	if got, want := gaps(), []string{noListener(OutboundPort), noListener(InboundPlainPort), noListener(HBONEPort)}; !slices.Equal(got, want) {
		t.Fatalf("nothing listening: gaps %q, want %q", got, want)
	}
	listenAt(t, ns, "tcp4", "0.0.0.0:15001")
	listenAt(t, ns, "tcp6", "[::]:15006")
	connectFrom(t, ns, HBONEPort)
	if got, want := gaps(), []string{noListener(HBONEPort)}; !slices.Equal(got, want) {
		t.Fatalf("listening on 15001 (IPv4) and 15006 (IPv6), connected from 15008: gaps %q, want %q", got, want)
	}
	listenAt(t, ns, "tcp6", "[::1]:15008")
	if got := gaps(); len(got) > 0 {
		t.Fatalf("listening on all three: gaps %q", got)
	}
}

// BenchmarkCheckListeners: the check's cost in a pod holding 20,000
// closed connections (TIME_WAIT: the pod pays no descriptor for them)
// beside ztunnel's listeners; B/op is what the agent allocates for it.
//
//	go test -run '^$' -bench CheckListeners -benchmem ./reconcilers/inpod/
func BenchmarkCheckListeners(b *testing.B) {
	netnstest.RequirePrivileged(b)
	ns := netnstest.NewNS(b, "listeners")
	for _, addr := range []string{"[::]:15001", "[::]:15006", "[::]:15008"} {
		listenAt(b, ns, "tcp6", addr)
	}
	l := listenAt(b, ns, "tcp4", "127.0.0.1:9")
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	must(b, ns.Do(func() error {
		for range 20_000 {
			c, err := net.Dial("tcp4", "127.0.0.1:9")
			if err != nil {
				return err
			}
			c.Close()
		}
		return nil
	}))
	for b.Loop() {
		if gaps, err := checkListeners(ns.Handle); err != nil || len(gaps) > 0 {
			b.Fatal(gaps, err)
		}
	}
}

// connectFrom opens a loopback connection inside ns from local port port
// to a listener of its own; closed when the test ends.
func connectFrom(t testing.TB, ns *netnstest.NS, port int) {
	t.Helper()
	l := listenAt(t, ns, "tcp4", "127.0.0.1:9")
	accepted := make(chan net.Conn, 1)
	go func() {
		if c, err := l.Accept(); err == nil {
			accepted <- c
		}
	}()
	must(t, ns.Do(func() error {
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: port}}
		c, err := d.Dial("tcp4", "127.0.0.1:9")
		if err == nil {
			t.Cleanup(func() { c.Close() })
		}
		return err
	}))
	c := <-accepted
	t.Cleanup(func() { c.Close() })
}

// listenAt opens a TCP listener inside ns, closed when the test ends.
func listenAt(t testing.TB, ns *netnstest.NS, network, addr string) net.Listener {
	t.Helper()
	var l net.Listener
	must(t, ns.Do(func() (err error) {
		l, err = net.Listen(network, addr)
		return err
	}))
	t.Cleanup(func() { l.Close() })
	return l
}
