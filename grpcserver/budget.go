// SPDX-License-Identifier: Apache-2.0

package grpcserver

import (
	"context"
	"net"
	"net/netip"
	"sync"

	"golang.org/x/time/rate"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
)

// reviewBudget decides whether a TokenReview may be asked now. Callers
// from the addresses of this node's mTLS agent pods have a budget of their
// own; everyone else shares the global budget and each peer address has a
// small one besides, so that strangers with junk tokens neither starve the
// real mTLS agent nor each other.
type reviewBudget struct {
	global *rate.Limiter
	// perPeer is each peer's own budget.
	perPeer budget
	// trusted reports whether an address is one of this node's mTLS agent pods.
	trusted func(netip.Addr) bool

	mu    sync.Mutex
	peers map[netip.Addr]*rate.Limiter
}

// budget is a rate and a burst.
type budget struct {
	qps   float64
	burst int
}

// peerBudget is each peer's: a legitimate caller reviews a token when it
// is new or its verdict expired (30 s), far below this.
var peerBudget = budget{qps: 2, burst: 5}

// maxPeerBudgets bounds the peers remembered; beyond it the table starts
// over (a flood of source addresses).
const maxPeerBudgets = 4096

func newReviewBudget(global, perPeer budget, trusted func(netip.Addr) bool) *reviewBudget {
	return &reviewBudget{global: rate.NewLimiter(rate.Limit(global.qps), global.burst), perPeer: perPeer,
		trusted: trusted, peers: map[netip.Addr]*rate.Limiter{}}
}

// allow returns nil when the caller of ctx may have a review now, else a
// refusal that is not cached (the caller retries).
func (b *reviewBudget) allow(ctx context.Context) error {
	addr := peerAddr(ctx)
	if !b.peer(addr).Allow() {
		return refusal(codes.Unavailable, "tokenreview-budget", "too many token reviews from %s: retry", addr)
	}
	if addr.IsValid() && b.trusted(addr) {
		return nil
	}
	if !b.global.Allow() {
		return refusal(codes.Unavailable, "tokenreview-budget", "too many token reviews (--token-review-qps=%g): retry", float64(b.global.Limit()))
	}
	return nil
}

func (b *reviewBudget) peer(addr netip.Addr) *rate.Limiter {
	b.mu.Lock()
	defer b.mu.Unlock()
	l, ok := b.peers[addr]
	if !ok {
		if len(b.peers) >= maxPeerBudgets {
			clear(b.peers)
		}
		l = rate.NewLimiter(rate.Limit(b.perPeer.qps), b.perPeer.burst)
		b.peers[addr] = l
	}
	return l
}

// peerAddr is the caller's address, or the zero address when unknown.
func peerAddr(ctx context.Context) netip.Addr {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return netip.Addr{}
	}
	if tcp, ok := p.Addr.(*net.TCPAddr); ok {
		return tcp.AddrPort().Addr().Unmap()
	}
	return netip.Addr{}
}
