// SPDX-License-Identifier: Apache-2.0

package bypass

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/mtlsbridge/mtlsbridge/bpf"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/redirect"
)

// pinnedKernel reads the datapath through its pins under --bpf-root, and
// the node's interfaces through netlink in the node's network namespace.
// It opens everything anew at each call, and so sees what another process
// (or a person with bpftool) did behind the agent's back.
type pinnedKernel struct {
	root  string
	netns netns.NsHandle // netns.None() for the agent's own
}

var _ Kernel = (*pinnedKernel)(nil)

// Entries implements Kernel.
func (k *pinnedKernel) Entries() (map[netip.Addr]bpf.Entry, error) {
	pin := filepath.Join(k.root, bpf.MapName)
	m, err := ebpf.LoadPinnedMap(pin, &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", pin, err)
	}
	defer m.Close()
	return bpf.NewRedirectMap(m).Dump()
}

// Link implements Kernel: the link the redirect reconciler pinned for device.
func (k *pinnedKernel) Link(device string) (bpf.LinkInfo, error) {
	pin := redirect.LinkPin(k.root, device)
	var li bpf.LinkInfo
	err := k.do(func() error {
		var err error
		li, err = bpf.PinnedLink(pin)
		return err
	})
	return li, err
}

// Interface implements Kernel.
func (k *pinnedKernel) Interface(ifindex int) (string, bool, error) {
	h, err := netlink.NewHandleAt(k.netns)
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

// do runs fn on an OS thread in the node's namespace.
func (k *pinnedKernel) do(fn func() error) error { return redirect.InNetns(k.netns, fn) }
