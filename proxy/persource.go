// SPDX-License-Identifier: Apache-2.0

package proxy

import (
	"net/netip"
	"sync"
)

// perSource counts what each source address holds, up to max each.
type perSource struct {
	max int
	mu  sync.Mutex
	n   map[netip.Addr]int
}

func newPerSource(max int) *perSource { return &perSource{max: max, n: map[netip.Addr]int{}} }

// take counts one more for addr, unless it holds max already; release
// (idempotent) gives it back.
func (s *perSource) take(addr netip.Addr) (release func(), ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.n[addr] >= s.max {
		return nil, false
	}
	s.n[addr]++
	var once sync.Once
	return func() {
		once.Do(func() {
			s.mu.Lock()
			defer s.mu.Unlock()
			if s.n[addr]--; s.n[addr] == 0 {
				delete(s.n, addr)
			}
		})
	}, true
}
