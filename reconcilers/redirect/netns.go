// SPDX-License-Identifier: Apache-2.0

package redirect

import (
	"errors"
	"fmt"
	"runtime"

	"github.com/cilium/hive/cell"
	"github.com/vishvananda/netns"
)

// nodeNetns is the network namespace of the node's devices: the agent's own
// unless --node-netns names another. Interface indexes given to the kernel
// (TCX attach, program queries) are resolved in the namespace of the
// calling thread, hence do.
type nodeNetns struct {
	handle netns.NsHandle // netns.None() for the agent's own
}

func newNodeNetns(lc cell.Lifecycle, cfg Config) (*nodeNetns, error) {
	if cfg.NodeNetns == "" || !cfg.EnableRedirect {
		return &nodeNetns{handle: netns.None()}, nil
	}
	h, err := netns.GetFromPath(cfg.NodeNetns)
	if err != nil {
		return nil, fmt.Errorf("--node-netns=%s: %w", cfg.NodeNetns, err)
	}
	n := &nodeNetns{handle: h}
	lc.Append(cell.Hook{OnStop: func(cell.HookContext) error { return h.Close() }})
	return n, nil
}

// do runs fn on an OS thread in the node's namespace (a locked thread of
// its own when that is not the agent's namespace).
func (n *nodeNetns) do(fn func() error) error { return InNetns(n.handle, fn) }

// InNetns runs fn on an OS thread in the namespace h, or right here when h
// is not open (the agent's own namespace). Interface indexes given to the
// kernel (netlink, TCX) are resolved in the calling thread's namespace.
func InNetns(h netns.NsHandle, fn func() error) error {
	if !h.IsOpen() {
		return fn()
	}
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			errc <- err
			return // the thread stays locked and dies with the goroutine
		}
		defer orig.Close()
		if err := netns.Set(h); err != nil {
			errc <- err
			return
		}
		ferr := fn()
		if err := netns.Set(orig); err != nil {
			errc <- errors.Join(ferr, err)
			return
		}
		runtime.UnlockOSThread()
		errc <- ferr
	}()
	return <-errc
}
