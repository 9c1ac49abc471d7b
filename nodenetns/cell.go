// SPDX-License-Identifier: Apache-2.0

// Package nodenetns is the node's network namespace: the agent's own (it
// runs on the host's network), unless --node-netns names another, as tests
// do that run agents beside nodes made of network namespaces. The l2 mode
// finds the node's devices and attaches programs there; the in-pod mode
// writes the node's SNAT of kubelet probes there.
package nodenetns

import (
	"fmt"

	"github.com/cilium/hive/cell"
	"github.com/spf13/pflag"
	"github.com/vishvananda/netns"

	"github.com/mtlsbridge/mtlsbridge/internal/nsthread"
)

// Cell provides the node's namespace.
var Cell = cell.Module(
	"nodenetns",
	"Network namespace of the node",

	cell.Config(Config{}),
	cell.Provide(newNamespace),
)

// Config names the namespace.
type Config struct {
	// NodeNetns is the path of the node's network namespace; empty means
	// the agent's own (flag --node-netns).
	NodeNetns string
}

// Flags implements cell.Flagger.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.String("node-netns", def.NodeNetns, "Network namespace (path) of the node: its devices, and its own connections to pods; empty: the agent's own")
}

// Namespace is the node's network namespace. Interface indexes given to the
// kernel (TCX attach, program queries) and netlink sockets opened without a
// namespace of their own belong to the calling thread's namespace, hence
// Do.
type Namespace struct {
	handle netns.NsHandle // netns.None() for the agent's own
}

func newNamespace(lc cell.Lifecycle, cfg Config) (*Namespace, error) {
	if cfg.NodeNetns == "" {
		return &Namespace{handle: netns.None()}, nil
	}
	h, err := netns.GetFromPath(cfg.NodeNetns)
	if err != nil {
		return nil, fmt.Errorf("--node-netns=%s: %w", cfg.NodeNetns, err)
	}
	lc.Append(cell.Hook{OnStop: func(cell.HookContext) error { return h.Close() }})
	return &Namespace{handle: h}, nil
}

// Do runs fn on an OS thread in the node's namespace: a locked thread of
// its own when that is not the agent's namespace, else right here.
func (n *Namespace) Do(fn func() error) error {
	if !n.handle.IsOpen() {
		return fn()
	}
	return nsthread.Do(n.handle, fn)
}

// Handle is the namespace for netlink calls that take one: netns.None()
// for the agent's own, which they read as the calling thread's.
func (n *Namespace) Handle() netns.NsHandle { return n.handle }
