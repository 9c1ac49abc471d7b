// SPDX-License-Identifier: Apache-2.0

package inpod

import (
	"errors"
	"net"
	"net/netip"
	"os"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mtlsbridge/mtlsbridge/internal/netnstest"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/steering"
)

// TestCloseConnections: the connections named are aborted in the pod's
// namespace, IPv4, IPv6 and one bound to an interface, the pod's end
// sees it at once; a connection not named lives on, and one that is not
// there is no error, also where a listener has its local end, which
// lives on.
func TestCloseConnections(t *testing.T) {
	netnstest.RequirePrivileged(t)
	ns := netnstest.NewNS(t, "closeconns")
	type pair struct{ pod, peer net.Conn }
	connect := func(network, addr string, d net.Dialer) pair {
		t.Helper()
		l := listenAt(t, ns, network, addr)
		accepted := make(chan net.Conn, 1)
		go func() {
			if c, err := l.Accept(); err == nil {
				accepted <- c
			}
		}()
		var p pair
		must(t, ns.Do(func() (err error) {
			p.pod, err = d.Dial(network, l.Addr().String())
			return err
		}))
		t.Cleanup(func() { p.pod.Close() })
		p.peer = <-accepted
		t.Cleanup(func() { p.peer.Close() })
		return p
	}
	ends := func(p pair) steering.Conn {
		return steering.Conn{Local: netip.MustParseAddrPort(p.pod.LocalAddr().String()), Remote: netip.MustParseAddrPort(p.pod.RemoteAddr().String())}
	}
	boundToLo := net.Dialer{Control: func(_, _ string, c syscall.RawConn) error {
		var err error
		c.Control(func(fd uintptr) { err = unix.SetsockoptString(int(fd), unix.SOL_SOCKET, unix.SO_BINDTODEVICE, "lo") })
		return err
	}}
	v4, v6, kept := connect("tcp4", "127.0.0.1:0", net.Dialer{}), connect("tcp6", "[::1]:0", net.Dialer{}), connect("tcp4", "127.0.0.1:0", net.Dialer{})
	bound := connect("tcp4", "127.0.0.1:0", boundToLo)
	gone := steering.Conn{Local: netip.MustParseAddrPort("127.0.0.1:1"), Remote: netip.MustParseAddrPort("127.0.0.1:2")}
	listener := listenAt(t, ns, "tcp6", "[::]:0")
	goneFromListener := steering.Conn{Local: netip.AddrPortFrom(netip.IPv6Loopback(), uint16(listener.Addr().(*net.TCPAddr).Port)),
		Remote: netip.MustParseAddrPort("[::1]:2")}

	closed, err := netlinkTarget{}.CloseConnections("/var/run/netns/"+ns.Name, []netip.Addr{netip.MustParseAddr("127.0.0.1"), netip.IPv6Loopback()},
		[]steering.Conn{ends(v4), goneFromListener, ends(v6), gone, ends(bound)})
	if err != nil || closed != 3 {
		t.Fatalf("closed %d, %v; want the IPv4, the IPv6 and the bound connection", closed, err)
	}
	for _, p := range []pair{v4, v6, bound} {
		p.pod.SetReadDeadline(time.Now().Add(time.Second))
		if _, err := p.pod.Read(make([]byte, 1)); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
			t.Errorf("%s -> %s: read %v, want the connection aborted", p.pod.LocalAddr(), p.pod.RemoteAddr(), err)
		}
	}
	must(t, ns.Do(func() error {
		c, err := net.Dial("tcp6", goneFromListener.Local.String())
		if err == nil {
			c.Close()
		}
		return err
	}))
	if _, err := kept.pod.Write([]byte("x")); err != nil {
		t.Fatalf("the connection not named: %v", err)
	}
	kept.peer.SetReadDeadline(time.Now().Add(time.Second))
	if _, err := kept.peer.Read(make([]byte, 1)); err != nil {
		t.Errorf("the connection not named does not carry data: %v", err)
	}
}

// TestCloseAll: every connection of the namespace is aborted, both of
// its ends where both are in it, IPv4 and IPv6; listeners stay.
func TestCloseAll(t *testing.T) {
	netnstest.RequirePrivileged(t)
	ns := netnstest.NewNS(t, "closeall")
	var conns []net.Conn
	var listeners []net.Listener
	for _, c := range []struct{ network, addr string }{{"tcp4", "127.0.0.1:0"}, {"tcp6", "[::1]:0"}} {
		l := listenAt(t, ns, c.network, c.addr)
		listeners = append(listeners, l)
		accepted := make(chan net.Conn, 1)
		go func() {
			if c, err := l.Accept(); err == nil {
				accepted <- c
			}
		}()
		must(t, ns.Do(func() error {
			pod, err := net.Dial(c.network, l.Addr().String())
			if err == nil {
				t.Cleanup(func() { pod.Close() })
				conns = append(conns, pod)
			}
			return err
		}))
		peer := <-accepted
		t.Cleanup(func() { peer.Close() })
		conns = append(conns, peer)
	}
	path := "/var/run/netns/" + ns.Name
	target := netlinkTarget{}
	id, err := target.Identify(path)
	must(t, err)
	// An end aborted resets the other (loopback): gone before its turn,
	// it is not counted.
	if closed, err := target.CloseAll(path, id); err != nil || closed < 2 || closed > 4 {
		t.Fatalf("closed %d, %v; want both connections", closed, err)
	}
	for _, c := range conns {
		c.SetReadDeadline(time.Now().Add(time.Second))
		if _, err := c.Read(make([]byte, 1)); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
			t.Errorf("%s -> %s: read %v, want the connection aborted", c.LocalAddr(), c.RemoteAddr(), err)
		}
	}
	for _, l := range listeners {
		must(t, ns.Do(func() error {
			c, err := net.Dial("tcp", l.Addr().String())
			if err == nil {
				c.Close()
			}
			return err
		}))
	}
	if closed, err := target.CloseAll(path, NetnsID{Dev: id.Dev, Ino: id.Ino + 1}); err != nil || closed != 0 {
		t.Errorf("another namespace's identity: closed %d, %v; want nothing (the one at the path is not it)", closed, err)
	}
}
