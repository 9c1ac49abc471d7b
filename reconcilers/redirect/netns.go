// SPDX-License-Identifier: Apache-2.0

package redirect

import (
	"fmt"

	"github.com/cilium/hive/cell"
	"github.com/vishvananda/netns"

	"github.com/mtlsbridge/mtlsbridge/internal/nsthread"
)

// NodeNetns is the network namespace of the node's devices: the agent's own
// unless --node-netns names another. Interface indexes given to the kernel
// (TCX attach, program queries) are resolved in the namespace of the
// calling thread, hence Do.
type NodeNetns struct {
	handle netns.NsHandle // netns.None() for the agent's own
}

type nodeNetnsParams struct {
	cell.In

	Lifecycle cell.Lifecycle
	Config    Config
}

func newNodeNetns(p nodeNetnsParams) (*NodeNetns, error) {
	lc, cfg := p.Lifecycle, p.Config
	// Opened in another mode too: the hand-over of the l2 pins looks for
	// the pods' interfaces there.
	if cfg.NodeNetns == "" || !cfg.EnableRedirect {
		return &NodeNetns{handle: netns.None()}, nil
	}
	h, err := netns.GetFromPath(cfg.NodeNetns)
	if err != nil {
		return nil, fmt.Errorf("--node-netns=%s: %w", cfg.NodeNetns, err)
	}
	n := &NodeNetns{handle: h}
	lc.Append(cell.Hook{OnStop: func(cell.HookContext) error { return h.Close() }})
	return n, nil
}

// Do runs fn on an OS thread in the node's namespace (a locked thread of
// its own when that is not the agent's namespace).
func (n *NodeNetns) Do(fn func() error) error { return inNetns(n.handle, fn) }

// inNetns runs fn on an OS thread in the namespace h, or right here when h
// is not open (the agent's own namespace). Interface indexes given to the
// kernel (netlink, TCX) are resolved in the calling thread's namespace.
func inNetns(h netns.NsHandle, fn func() error) error {
	if !h.IsOpen() {
		return fn()
	}
	return nsthread.Do(h, fn)
}
