// SPDX-License-Identifier: Apache-2.0

// Package nsthread runs a function inside another network namespace. A
// namespace belongs to an OS thread, not to a goroutine: the function runs
// on a thread locked for it, switched in and back.
package nsthread

import (
	"errors"
	"fmt"
	"runtime"

	"github.com/vishvananda/netns"
)

// Do runs fn on an OS thread of its own switched into the namespace h.
// Sockets fn opens belong to h and may be used from any goroutine
// afterwards; fn may block. A thread that cannot be switched back stays
// locked, and the runtime discards it with its goroutine.
func Do(h netns.NsHandle, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			errc <- fmt.Errorf("the thread's namespace: %w", err)
			return
		}
		defer orig.Close()
		if err := netns.Set(h); err != nil {
			errc <- fmt.Errorf("enter namespace: %w", err)
			return
		}
		ferr := fn()
		if err := netns.Set(orig); err != nil {
			errc <- errors.Join(ferr, fmt.Errorf("leave namespace: %w", err))
			return
		}
		runtime.UnlockOSThread()
		errc <- ferr
	}()
	return <-errc
}
