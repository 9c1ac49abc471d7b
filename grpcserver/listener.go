// SPDX-License-Identifier: Apache-2.0

package grpcserver

import (
	"net"
	"net/netip"
	"sync"
)

// pooledListener bounds the connections served at once in two pools: one
// for callers known by their address (this node's mTLS agent pods), and
// one for everyone else. The listener cannot tell a stranger from a caller
// until a stream is authenticated, and a stranger may hold connections
// open without a stream: with a single pool, strangers that fill it lock
// the callers out. In the others' pool one address holds at most
// connectionsPerAddress, so that filling it takes many pods, not one
// (Cilium lets a pod send from its own addresses only). A connection
// beyond its bound is closed at once rather than left waiting in the
// accept queue in front of the callers'.
type pooledListener struct {
	net.Listener
	isAgent func(netip.Addr) bool
	// agents and others are semaphores, one slot a connection.
	agents, others chan struct{}
	// refused is called for each connection closed: its pool was full
	// ("agents", "others"), or its address held its share ("address").
	refused func(pool string)

	mu sync.Mutex
	// perAddress counts the others' connections by address.
	perAddress map[netip.Addr]int
}

// agentConnections is the agent pool's bound: ztunnel and the reference
// agent hold one or two connections each, and a rolling update runs two.
const agentConnections = 16

// connectionsPerAddress is one address's share of the others' pool. A
// caller holds one connection, two while its pod is replaced: the signer's
// callers are node agents, one per node address.
const connectionsPerAddress = 8

func newPooledListener(l net.Listener, others int, isAgent func(netip.Addr) bool, refused func(string)) *pooledListener {
	return &pooledListener{Listener: l, isAgent: isAgent, refused: refused,
		agents: make(chan struct{}, agentConnections), others: make(chan struct{}, others),
		perAddress: map[netip.Addr]int{}}
}

func (l *pooledListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		addr := remoteAddr(c)
		switch {
		case addr.IsValid() && l.isAgent(addr):
			if take(l.agents) {
				return &pooledConn{Conn: c, release: sync.OnceFunc(func() { <-l.agents })}, nil
			}
			l.refuse(c, "agents")
		case !l.takeShare(addr):
			l.refuse(c, "address")
		case !take(l.others):
			l.releaseShare(addr)
			l.refuse(c, "others")
		default:
			return &pooledConn{Conn: c, release: sync.OnceFunc(func() { <-l.others; l.releaseShare(addr) })}, nil
		}
	}
}

func remoteAddr(c net.Conn) netip.Addr {
	addr, err := netip.ParseAddrPort(c.RemoteAddr().String())
	if err != nil {
		return netip.Addr{}
	}
	return addr.Addr().Unmap()
}

// take takes a slot of pool if one is free.
func take(pool chan struct{}) bool {
	select {
	case pool <- struct{}{}:
		return true
	default:
		return false
	}
}

func (l *pooledListener) refuse(c net.Conn, why string) {
	c.Close()
	l.refused(why)
}

// takeShare counts a connection in its address's share if there is room.
func (l *pooledListener) takeShare(addr netip.Addr) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.perAddress[addr] >= connectionsPerAddress {
		return false
	}
	l.perAddress[addr]++
	return true
}

func (l *pooledListener) releaseShare(addr netip.Addr) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.perAddress[addr]--; l.perAddress[addr] == 0 {
		delete(l.perAddress, addr)
	}
}

// pooledConn gives its slots back when closed.
type pooledConn struct {
	net.Conn
	release func()
}

func (c *pooledConn) Close() error {
	err := c.Conn.Close()
	c.release()
	return err
}
