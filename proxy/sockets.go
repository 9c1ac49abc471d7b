// SPDX-License-Identifier: Apache-2.0

package proxy

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// dialTimeout bounds every TCP connect of the proxy.
const dialTimeout = 5 * time.Second

// setTransparent sets IP_TRANSPARENT (IPV6_TRANSPARENT): a listener
// accepts what TPROXY assigns to it whatever the destination, and a socket
// may bind a source address the namespace does not have (a pod's).
func setTransparent(c syscall.RawConn, ipv6 bool) error {
	var serr error
	err := c.Control(func(fd uintptr) {
		if ipv6 {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_IPV6, unix.IPV6_TRANSPARENT, 1)
		} else {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_IP, unix.IP_TRANSPARENT, 1)
		}
	})
	return errors.Join(err, serr)
}

// listenTransparent opens a TCP listener for TPROXY on addr (host:port).
func listenTransparent(ctx context.Context, addr string) (net.Listener, error) {
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		return nil, err
	}
	network := "tcp4"
	if ap.Addr().Is6() {
		network = "tcp6"
	}
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error { return setTransparent(c, ap.Addr().Is6()) }}
	return lc.Listen(ctx, network, addr)
}

// dialer connects to dst in the name of src, a pod's address: dialFrom in
// the proxy's own namespace (l2 mode), or from inside the pod's namespace
// (in-pod mode).
type dialer func(ctx context.Context, src netip.Addr, dst netip.AddrPort) (*net.TCPConn, error)

// dialFrom connects to dst with src as source address (any free port),
// though src is not an address of this namespace: the connection leaves in
// the name of the pod that owns src, and the node steers the replies back.
// An invalid src dials from the namespace's own address.
func dialFrom(ctx context.Context, src netip.Addr, dst netip.AddrPort) (*net.TCPConn, error) {
	d := net.Dialer{Timeout: dialTimeout}
	if src.IsValid() {
		d.LocalAddr = net.TCPAddrFromAddrPort(netip.AddrPortFrom(src, 0))
		d.Control = func(_, _ string, c syscall.RawConn) error { return setTransparent(c, src.Is6()) }
	}
	network := "tcp4"
	if dst.Addr().Is6() {
		network = "tcp6"
	}
	c, err := d.DialContext(ctx, network, dst.String())
	if err != nil {
		return nil, err
	}
	return c.(*net.TCPConn), nil
}

// addrPort is a connection address without IPv4-mapped forms.
func addrPort(a net.Addr) netip.AddrPort {
	if t, ok := a.(*net.TCPAddr); ok {
		ap := t.AddrPort()
		return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
	}
	ap, _ := netip.ParseAddrPort(a.String())
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
}

// tcpStream is a TCP connection as one end of a relay, able to wait for
// data without a buffer.
type tcpStream struct {
	*net.TCPConn
	rc syscall.RawConn
}

// newTCPStream wraps c; a connection without a descriptor (never, for
// TCP) stays as it is and waits for data holding a buffer.
func newTCPStream(c *net.TCPConn) halfStream {
	rc, err := c.SyscallConn()
	if err != nil {
		return c
	}
	return &tcpStream{TCPConn: c, rc: rc}
}

// waitReadable returns once a read would not block: data, the peer's end,
// or an error is there. It peeks at the socket rather than trusting the
// poller alone, which reports only new arrivals.
func (s *tcpStream) waitReadable() error {
	return s.rc.Read(func(fd uintptr) bool {
		var b [1]byte
		_, _, err := unix.Recvfrom(int(fd), b[:], unix.MSG_PEEK|unix.MSG_DONTWAIT)
		return err != unix.EAGAIN && err != unix.EINTR
	})
}

// originalDst reads the destination a REDIRECTed connection had
// (SO_ORIGINAL_DST, IP6T_SO_ORIGINAL_DST: both 80).
func originalDst(c *net.TCPConn) (netip.AddrPort, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return netip.AddrPort{}, err
	}
	const soOriginalDst = 80
	v6 := addrPort(c.LocalAddr()).Addr().Is6()
	var out netip.AddrPort
	var serr error
	err = rc.Control(func(fd uintptr) {
		if !v6 {
			var sa unix.RawSockaddrInet4
			l := uint32(unsafe.Sizeof(sa))
			if _, _, e := unix.Syscall6(unix.SYS_GETSOCKOPT, fd, unix.SOL_IP, soOriginalDst,
				uintptr(unsafe.Pointer(&sa)), uintptr(unsafe.Pointer(&l)), 0); e != 0 {
				serr = fmt.Errorf("SO_ORIGINAL_DST: %w", e)
				return
			}
			out = netip.AddrPortFrom(netip.AddrFrom4(sa.Addr), ntohs(sa.Port))
			return
		}
		var sa unix.RawSockaddrInet6
		l := uint32(unsafe.Sizeof(sa))
		if _, _, e := unix.Syscall6(unix.SYS_GETSOCKOPT, fd, unix.SOL_IPV6, soOriginalDst,
			uintptr(unsafe.Pointer(&sa)), uintptr(unsafe.Pointer(&l)), 0); e != 0 {
			serr = fmt.Errorf("IP6T_SO_ORIGINAL_DST: %w", e)
			return
		}
		out = netip.AddrPortFrom(netip.AddrFrom16(sa.Addr).Unmap(), ntohs(sa.Port))
	})
	return out, errors.Join(err, serr)
}

// ntohs swaps a port from network order as read into a uint16.
func ntohs(p uint16) uint16 {
	b := (*[2]byte)(unsafe.Pointer(&p))
	return binary.BigEndian.Uint16(b[:])
}
