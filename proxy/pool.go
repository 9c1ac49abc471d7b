// SPDX-License-Identifier: Apache-2.0

package proxy

import (
	"net/netip"
	"sync"

	"golang.org/x/net/http2"
)

// tunnelKey says which HBONE connections a new tunnel may share, as
// ztunnel pools them: the same source pod address (the connection leaves
// from it, and the peer checks it against the identity), the same
// identities proved at both ends, the same destination address.
type tunnelKey struct {
	src, dst     netip.Addr
	srcID, dstID string
}

// tunnelPool keeps the HBONE connections of the proxy: a new tunnel
// becomes a new HTTP/2 stream on an open connection when one has room,
// saving a TCP and a TLS handshake to the peer. Connections close
// themselves when idle (the transport's idle timeout) and leave the pool
// at the next look-up or sweep.
type tunnelPool struct {
	mu    sync.Mutex
	conns map[tunnelKey][]pooledConn
}

// pooledConn is an HBONE connection and the identity its peer proved in
// the handshake (the key's dstID, or it would not have been kept).
type pooledConn struct {
	cc     *http2.ClientConn
	proved string
}

func newTunnelPool() *tunnelPool {
	return &tunnelPool{conns: map[tunnelKey][]pooledConn{}}
}

// reserve returns a connection of the key with a stream reserved for the
// caller's next RoundTrip, or a zero pooledConn.
func (p *tunnelPool) reserve(key tunnelKey) pooledConn {
	p.mu.Lock()
	defer p.mu.Unlock()
	var found pooledConn
	live := p.conns[key][:0]
	for _, c := range p.conns[key] {
		if st := c.cc.State(); st.Closed || st.Closing {
			continue
		}
		live = append(live, c)
		if found.cc == nil && c.cc.ReserveNewRequest() {
			found = c
		}
	}
	p.set(key, live)
	return found
}

// add makes a new connection available to later tunnels of the key.
func (p *tunnelPool) add(key tunnelKey, c pooledConn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.conns[key] = append(p.conns[key], c)
}

// sweep forgets closed connections of every key.
func (p *tunnelPool) sweep() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for key, list := range p.conns {
		live := list[:0]
		for _, c := range list {
			if st := c.cc.State(); !st.Closed {
				live = append(live, c)
			}
		}
		p.set(key, live)
	}
}

// closeAll closes every connection (the proxy stops).
func (p *tunnelPool) closeAll() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for key, list := range p.conns {
		for _, c := range list {
			c.cc.Close()
		}
		delete(p.conns, key)
	}
}

func (p *tunnelPool) set(key tunnelKey, live []pooledConn) {
	if len(live) == 0 {
		delete(p.conns, key)
		return
	}
	p.conns[key] = live
}

// size is the number of connections held.
func (p *tunnelPool) size() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, list := range p.conns {
		n += len(list)
	}
	return n
}
