// SPDX-License-Identifier: Apache-2.0

// Package logthrottle keeps a warning that strangers can trigger at will
// (refused callers, garbage requests) from flooding the node's logs: a
// kind of line is written at most once per interval, with the number of
// lines kept quiet since. The events are still counted in metrics.
package logthrottle

import (
	"sync"
	"time"
)

// Throttle lets each key through at most once per interval.
type Throttle struct {
	interval time.Duration

	mu   sync.Mutex
	keys map[string]*state
}

type state struct {
	last       time.Time
	suppressed int
}

// maxKeys bounds the keys remembered; beyond it they start over.
const maxKeys = 1024

// New returns a throttle of the given interval.
func New(interval time.Duration) *Throttle {
	return &Throttle{interval: interval, keys: map[string]*state{}}
}

// Allow reports whether a line of key may be written now, and how many
// were suppressed since the last one.
func (t *Throttle) Allow(key string) (suppressed int, ok bool) {
	now := time.Now()
	t.mu.Lock()
	defer t.mu.Unlock()
	s := t.keys[key]
	if s == nil {
		if len(t.keys) >= maxKeys {
			clear(t.keys)
		}
		s = &state{}
		t.keys[key] = s
	}
	if !s.last.IsZero() && now.Sub(s.last) < t.interval {
		s.suppressed++
		return 0, false
	}
	suppressed, s.suppressed, s.last = s.suppressed, 0, now
	return suppressed, true
}
