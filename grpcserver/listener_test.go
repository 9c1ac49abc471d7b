// SPDX-License-Identifier: Apache-2.0

package grpcserver

import (
	"io"
	"net"
	"net/netip"
	"testing"
	"time"
)

// Strangers that fill their pool do not lock the node's mTLS agent out:
// its connections have a pool of their own, and one beyond a full pool is
// closed at once, not queued in front of the agent's.
func TestStrangersCannotTakeTheAgentsConnections(t *testing.T) {
	agentAddr := netip.MustParseAddr("127.0.0.2") // loopback: 127/8
	l := startPooledListener(t, 2, func(a netip.Addr) bool { return a == agentAddr })
	stranger, other := netip.MustParseAddr("127.0.0.1"), netip.MustParseAddr("127.0.0.3")
	l.dial(stranger)
	first := l.served()
	l.dial(other)
	l.served()
	// The strangers' pool is full: the next one is closed at once...
	l.closedAtOnce(stranger, "others")
	// ...and the agent is served.
	l.dial(agentAddr)
	l.served()
	// A stranger's slot comes back when its connection is closed.
	first.Close()
	l.dial(stranger)
	l.served()
}

// One address (a pod: Cilium drops what it sends from another) holds its
// share of the others' pool and no more: it cannot fill the pool alone,
// and its share comes back as its connections close.
func TestOneAddressHoldsItsShare(t *testing.T) {
	l := startPooledListener(t, 2*connectionsPerAddress, func(netip.Addr) bool { return false })
	stranger, caller := netip.MustParseAddr("127.0.0.1"), netip.MustParseAddr("127.0.0.2")
	var held []net.Conn
	for range connectionsPerAddress {
		l.dial(stranger)
		held = append(held, l.served())
	}
	l.closedAtOnce(stranger, "address")
	l.dial(caller)
	l.served()
	held[0].Close()
	l.dial(stranger)
	l.served()
}

type testListener struct {
	t        *testing.T
	addr     string
	accepted chan net.Conn
	refused  chan string
}

func startPooledListener(t *testing.T, others int, isAgent func(netip.Addr) bool) *testListener {
	inner, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	tl := &testListener{t: t, addr: inner.Addr().String(), accepted: make(chan net.Conn, 64), refused: make(chan string, 64)}
	l := newPooledListener(inner, others, isAgent, func(pool string) { tl.refused <- pool })
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { c.Close() })
			tl.accepted <- c
		}
	}()
	return tl
}

func (l *testListener) dial(from netip.Addr) net.Conn {
	l.t.Helper()
	d := net.Dialer{LocalAddr: net.TCPAddrFromAddrPort(netip.AddrPortFrom(from, 0)), Timeout: 5 * time.Second}
	c, err := d.Dial("tcp", l.addr)
	if err != nil {
		l.t.Fatal(err)
	}
	l.t.Cleanup(func() { c.Close() })
	return c
}

// served waits for the listener to hand out the next connection.
func (l *testListener) served() net.Conn {
	l.t.Helper()
	select {
	case c := <-l.accepted:
		return c
	case <-time.After(5 * time.Second):
		l.t.Fatal("connection not served")
		return nil
	}
}

// closedAtOnce dials from and checks that the connection is closed, for
// the reason given.
func (l *testListener) closedAtOnce(from netip.Addr, why string) {
	l.t.Helper()
	c := l.dial(from)
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err != io.EOF {
		l.t.Fatalf("connection from %s: read %v, want EOF (closed)", from, err)
	}
	select {
	case got := <-l.refused:
		if got != why {
			l.t.Errorf("connection from %s refused as %q, want %q", from, got, why)
		}
	case <-time.After(5 * time.Second):
		l.t.Fatalf("connection from %s closed but not counted", from)
	}
}
