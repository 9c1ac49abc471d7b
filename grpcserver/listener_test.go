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
	inner, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	agentAddr := netip.MustParseAddr("127.0.0.2") // loopback: 127/8
	refused := make(chan string, 16)
	l := newPooledListener(inner, 2, func(a netip.Addr) bool { return a == agentAddr }, func(pool string) { refused <- pool })
	defer l.Close()
	accepted := make(chan net.Conn, 16)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			accepted <- c
		}
	}()
	dial := func(from netip.Addr) net.Conn {
		t.Helper()
		d := net.Dialer{LocalAddr: net.TCPAddrFromAddrPort(netip.AddrPortFrom(from, 0)), Timeout: 5 * time.Second}
		c, err := d.Dial("tcp", inner.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	served := func() net.Conn {
		t.Helper()
		select {
		case c := <-accepted:
			return c
		case <-time.After(5 * time.Second):
			t.Fatal("connection not served")
			return nil
		}
	}
	stranger := netip.MustParseAddr("127.0.0.1")
	dial(stranger)
	first := served()
	dial(stranger)
	served()
	// The strangers' pool is full: the next one is closed at once...
	c := dial(stranger)
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err != io.EOF {
		t.Fatalf("stranger beyond the pool: read %v, want EOF (closed)", err)
	}
	if pool := <-refused; pool != "others" {
		t.Errorf("refused from pool %q, want others", pool)
	}
	// ...and the agent is served.
	dial(agentAddr)
	served()
	// A stranger's slot comes back when its connection is closed.
	first.Close()
	dial(stranger)
	served()
}
