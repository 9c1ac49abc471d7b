// SPDX-License-Identifier: Apache-2.0

// Package heapstat measures live heap for memory benchmarks.
package heapstat

import (
	"runtime"
	"time"
)

// Settled collects garbage until the live heap stops shrinking and returns
// it. One collection is not enough: finalizers and cleanups (statedb frees
// a change iterator's delete tracker in one) run after a collection, in
// their own goroutine, and release more for the next.
func Settled() int64 {
	var m runtime.MemStats
	last := int64(-1)
	for range 10 {
		runtime.GC()
		time.Sleep(10 * time.Millisecond)
		runtime.ReadMemStats(&m)
		now := int64(m.HeapAlloc)
		if last >= 0 && now >= last-last/100 {
			return now
		}
		last = now
	}
	return last
}
