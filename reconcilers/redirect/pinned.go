// SPDX-License-Identifier: Apache-2.0

package redirect

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"

	"github.com/mtlsbridge/mtlsbridge/bpf"
	"github.com/mtlsbridge/mtlsbridge/nodenetns"
)

// PinnedState reads the datapath through its pins under --bpf-root, and
// the node's interfaces through netlink in the node's network namespace.
// It opens everything anew at each call, and so sees what another process
// (or a person with bpftool) did behind the agent's back: the bypass check
// reads the kernel through it, never the reconcilers' tables.
type PinnedState struct {
	root  string
	netns *nodenetns.Namespace
}

func newPinnedState(cfg Config, netns *nodenetns.Namespace) *PinnedState {
	return &PinnedState{root: cfg.BPFRoot, netns: netns}
}

// Entries reads the redirect map.
func (k *PinnedState) Entries() (map[netip.Addr]bpf.Entry, error) {
	pin := filepath.Join(k.root, bpf.MapName)
	m, err := ebpf.LoadPinnedMap(pin, &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", pin, err)
	}
	defer m.Close()
	return bpf.NewRedirectMap(m).Dump()
}

// Link reads the from-pod link pinned for a device (First: whether its
// program is the first TCX ingress program of the link's interface).
//
// Possible errors: one wrapping os.ErrNotExist when nothing is pinned.
func (k *PinnedState) Link(device string) (bpf.LinkInfo, error) {
	pin := LinkPin(k.root, device)
	var li bpf.LinkInfo
	err := k.netns.Do(func() error {
		var err error
		li, err = bpf.PinnedLink(pin)
		return err
	})
	return li, err
}

// Interface returns the name of an interface of the node and whether it
// is up (administratively and operationally).
//
// Possible errors: one wrapping os.ErrNotExist when there is none.
func (k *PinnedState) Interface(ifindex int) (string, bool, error) {
	h, err := netlink.NewHandleAt(k.netns.Handle())
	if err != nil {
		return "", false, err
	}
	defer h.Close()
	l, err := h.LinkByIndex(ifindex)
	if err != nil {
		var notFound netlink.LinkNotFoundError
		if errors.As(err, &notFound) {
			return "", false, fmt.Errorf("%w: %w", os.ErrNotExist, err)
		}
		return "", false, err
	}
	a := l.Attrs()
	// Veth pairs report up only when both ends are; virtual devices
	// without carrier report unknown, which carries traffic.
	up := a.Flags&net.FlagUp != 0 && (a.OperState == netlink.OperUp || a.OperState == netlink.OperUnknown)
	return a.Name, up, nil
}
