// SPDX-License-Identifier: Apache-2.0

package grpcserver

import (
	"net"
	"net/netip"
	"sync"
)

// pooledListener bounds the connections served at once in two pools: one
// for this node's mTLS agent pods, known by their address, and one for
// everyone else. The listener cannot tell a stranger from the agent until
// a stream is authenticated, and a stranger may hold connections open
// without a stream: with a single pool, strangers that fill it lock the
// agent out. A connection beyond its pool's bound is closed at once rather
// than left waiting in the accept queue in front of the agent's.
type pooledListener struct {
	net.Listener
	isAgent func(netip.Addr) bool
	// agents and others are semaphores, one slot a connection.
	agents, others chan struct{}
	// refused is called for each connection closed for a full pool.
	refused func(pool string)
}

// agentConnections is the agent pool's bound: ztunnel and the reference
// agent hold one or two connections each, and a rolling update runs two.
const agentConnections = 16

func newPooledListener(l net.Listener, others int, isAgent func(netip.Addr) bool, refused func(string)) *pooledListener {
	return &pooledListener{Listener: l, isAgent: isAgent, refused: refused,
		agents: make(chan struct{}, agentConnections), others: make(chan struct{}, others)}
}

func (l *pooledListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		pool, name := l.others, "others"
		if addr, err := netip.ParseAddrPort(c.RemoteAddr().String()); err == nil && l.isAgent(addr.Addr().Unmap()) {
			pool, name = l.agents, "agents"
		}
		select {
		case pool <- struct{}{}:
			return &pooledConn{Conn: c, release: sync.OnceFunc(func() { <-pool })}, nil
		default:
			c.Close()
			l.refused(name)
		}
	}
}

// pooledConn gives its slot back when closed.
type pooledConn struct {
	net.Conn
	release func()
}

func (c *pooledConn) Close() error {
	err := c.Conn.Close()
	c.release()
	return err
}
