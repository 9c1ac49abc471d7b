// SPDX-License-Identifier: Apache-2.0

package proxy

import (
	"context"
	"fmt"
	"sync"
)

// liveConns are the inbound connections being relayed. A policy is
// checked when a connection opens and again at each change of what
// decides it: a DENY that arrives, or an ALLOW that goes, closes the
// connections it no longer allows (as ztunnel's policy watcher does).
type liveConns struct {
	mu    sync.Mutex
	conns map[*liveConn]struct{}
}

type liveConn struct {
	dstUID string
	conn   Connection
	cancel context.CancelCauseFunc
}

func newLiveConns() *liveConns { return &liveConns{conns: map[*liveConn]struct{}{}} }

// add registers a connection to dst: the context returned ends when a
// policy no longer allows it; done removes it. A connection is registered
// before its first check, so that no change falls between the two.
func (l *liveConns) add(ctx context.Context, dst *Workload, c Connection) (_ context.Context, done func()) {
	ctx, cancel := context.WithCancelCause(ctx)
	lc := &liveConn{dstUID: dst.UID, conn: c, cancel: cancel}
	l.mu.Lock()
	l.conns[lc] = struct{}{}
	l.mu.Unlock()
	return ctx, func() {
		l.mu.Lock()
		delete(l.conns, lc)
		l.mu.Unlock()
		cancel(nil)
	}
}

// recheck closes the connections the policies of state no longer allow.
// A destination gone from the state keeps its connections: its policies
// are unknown, not changed.
func (l *liveConns) recheck(state *State) (closed int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for lc := range l.conns {
		dst := state.ByUID(lc.dstUID)
		if dst == nil {
			continue
		}
		if d := Authorize(state.Policies(dst), lc.conn); !d.Allowed {
			lc.cancel(fmt.Errorf("%w since the connection opened: %s", ErrDenied, orNone(d.Policy)))
			delete(l.conns, lc)
			closed++
		}
	}
	return closed
}

// enforcePolicies rechecks the live inbound connections at each change of
// the policies or of this node's workloads.
func (p *Proxy) enforcePolicies(ctx context.Context) {
	changed := p.state.PoliciesChanged()
	for {
		select {
		case <-ctx.Done():
			return
		case <-changed:
		}
		// Taken before the recheck: a change during it wakes the next.
		changed = p.state.PoliciesChanged()
		if n := p.live.recheck(p.state); n > 0 {
			p.metrics.Refused.WithLabelValues(DirectionInbound, "denied-since").Add(float64(n))
		}
	}
}
