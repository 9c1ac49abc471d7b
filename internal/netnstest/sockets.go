// SPDX-License-Identifier: Apache-2.0

package netnstest

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// DialTimeout bounds every connection attempt of the helpers.
const DialTimeout = 3 * time.Second

// Answer is what a Serve listener tells each client: who answered, and the
// addresses of the connection as the server saw them. Local is where the
// client's packets were addressed to: for a transparent listener, the
// original destination.
type Answer struct {
	Server        string
	Local, Remote netip.AddrPort
}

func (a Answer) String() string {
	return fmt.Sprintf("%s (local %s, remote %s)", a.Server, a.Local, a.Remote)
}

// Serve opens TCP listeners on port for each address in the namespace and
// answers every connection with an Answer naming server. With transparent,
// the listeners accept connections addressed to any address (IP_TRANSPARENT,
// as an mTLS agent's TPROXY listeners); pass the unspecified addresses then.
// The listeners close when the test ends.
func (ns *NS) Serve(t testing.TB, server string, port uint16, transparent bool, addrs ...netip.Addr) {
	t.Helper()
	for _, addr := range addrs {
		network := "tcp4"
		if addr.Is6() {
			network = "tcp6"
		}
		lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
			if !transparent {
				return nil
			}
			return setTransparent(c, addr.Is6())
		}}
		var l net.Listener
		must(t, ns.Do(func() (err error) {
			l, err = lc.Listen(context.Background(), network, netip.AddrPortFrom(addr, port).String())
			return err
		}))
		t.Cleanup(func() { l.Close() })
		go func() {
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				go answer(c, server)
			}
		}()
	}
}

// answer tells the client who answered, then reads what the client sends
// (bounded) until it closes, so that a client's payload is received, not
// refused with a reset.
func answer(c net.Conn, server string) {
	defer c.Close()
	fmt.Fprintf(c, "%s %s %s\n", server, c.LocalAddr(), c.RemoteAddr())
	c.SetReadDeadline(time.Now().Add(DialTimeout))
	io.Copy(io.Discard, io.LimitReader(c, 1<<20))
}

// Ask connects from the namespace to addr and reads the Answer.
func (ns *NS) Ask(addr netip.AddrPort) (Answer, error) {
	return ns.AskFrom(netip.AddrPort{}, addr)
}

// AskFrom is Ask from a given local address, which need not be an address
// of the namespace (IP_TRANSPARENT, as an mTLS agent connecting in a pod's
// name). Port 0 picks a free port.
func (ns *NS) AskFrom(local, addr netip.AddrPort) (Answer, error) {
	return ns.ask(local, addr, nil)
}

// Send connects from the namespace to addr, sends payload and reads the
// Answer: TCP payload from the pod, as an application sends.
func (ns *NS) Send(addr netip.AddrPort, payload []byte) (Answer, error) {
	return ns.ask(netip.AddrPort{}, addr, payload)
}

func (ns *NS) ask(local, addr netip.AddrPort, payload []byte) (Answer, error) {
	d := net.Dialer{Timeout: DialTimeout}
	if local.IsValid() {
		d.LocalAddr = net.TCPAddrFromAddrPort(local)
		d.Control = func(_, _ string, c syscall.RawConn) error { return setTransparent(c, local.Addr().Is6()) }
	}
	var c net.Conn
	err := ns.Do(func() (err error) {
		c, err = d.Dial("tcp", addr.String())
		return err
	})
	if err != nil {
		return Answer{}, err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(DialTimeout))
	if len(payload) > 0 {
		if _, err := c.Write(payload); err != nil {
			return Answer{}, fmt.Errorf("send to %s: %w", addr, err)
		}
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return Answer{}, fmt.Errorf("read answer from %s: %w", addr, err)
	}
	return parseAnswer(line)
}

func parseAnswer(line string) (Answer, error) {
	f := strings.Fields(line)
	if len(f) != 3 {
		return Answer{}, fmt.Errorf("bad answer %q", line)
	}
	local, err1 := netip.ParseAddrPort(f[1])
	remote, err2 := netip.ParseAddrPort(f[2])
	if err := errors.Join(err1, err2); err != nil {
		return Answer{}, err
	}
	return Answer{Server: f[0], Local: local, Remote: remote}, nil
}

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

// Relay listens on listen (a loopback address) inside ns and carries each
// connection to target on the test's own loopback: how a process in a
// test namespace reaches a server the test runs (a kube-apiserver). It
// returns the address it listens on.
func (ns *NS) Relay(t testing.TB, listen, target string) string {
	t.Helper()
	var l net.Listener
	must(t, ns.Do(func() (err error) {
		l, err = net.Listen("tcp", listen)
		return err
	}))
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			in, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer in.Close()
				out, err := net.DialTimeout("tcp", target, DialTimeout)
				if err != nil {
					return
				}
				defer out.Close()
				go func() { io.Copy(out, in); out.(*net.TCPConn).CloseWrite() }()
				io.Copy(in, out)
			}()
		}
	}()
	return l.Addr().String()
}
