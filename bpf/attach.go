// SPDX-License-Identifier: Apache-2.0

package bpf

import (
	"errors"
	"fmt"
	"os"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
)

// Hook names a program together with the place it attaches to.
type Hook string

const (
	// HookFromPod is TCX ingress of a local pod's host-side interface.
	HookFromPod Hook = "from-pod"
	// HookNodeIngress is TCX ingress of an uplink or tunnel device (its
	// program depends on whether the device has an Ethernet header).
	HookNodeIngress Hook = "node-ingress"
)

// Attach makes the program of hook h the first TCX ingress program of
// interface ifindex, through a link pinned at pin. ifindex is resolved in
// the network namespace of the calling thread.
//
// It is idempotent and never leaves the interface without the program:
//   - a link pinned for this interface gets prog swapped in atomically
//     (a restarted agent brings its new program this way);
//   - a pinned link of another interface (the device went, the name came
//     back with another index) is dropped and a new link attached;
//   - when another program was placed before ours, a new link is attached
//     at the head before the old one is released, so for a moment both run
//     (the second sees only what the first passed on) and never neither.
func (o *Objects) Attach(h Hook, pin string, ifindex int) error {
	prog, spare, err := o.programs(h, ifindex)
	if err != nil {
		return err
	}
	old, err := link.LoadPinnedLink(pin, nil)
	switch {
	case errors.Is(err, os.ErrNotExist):
		old = nil
	case err != nil:
		return fmt.Errorf("load pinned link %s: %w", pin, err)
	default:
		defer old.Close()
		info, err := old.Info()
		if err != nil || info.TCX() == nil || int(info.TCX().Ifindex) != ifindex {
			// Not ours to keep: detached by a device deletion, or of a
			// device whose index changed.
			if err := old.Unpin(); err != nil {
				return fmt.Errorf("unpin stale link %s: %w", pin, err)
			}
			old = nil
		}
	}

	if old != nil {
		if err := old.Update(prog); err != nil {
			return fmt.Errorf("update link %s: %w", pin, err)
		}
		first, err := isFirst(ifindex, old)
		if err != nil || first {
			return err
		}
		// The old link keeps running the spare instance while prog moves
		// to the head.
		if err := old.Update(spare); err != nil {
			return fmt.Errorf("update link %s: %w", pin, err)
		}
	}

	l, err := link.AttachTCX(link.TCXOptions{
		Interface: ifindex,
		Program:   prog,
		Attach:    ebpf.AttachTCXIngress,
		Anchor:    link.Head(),
	})
	if err != nil {
		return fmt.Errorf("attach to ifindex %d: %w", ifindex, err)
	}
	defer l.Close()
	if old == nil {
		return l.Pin(pin)
	}
	// Replace the pin in one rename: the old link is released (detached)
	// only when its last reference, our fd, is closed after this.
	tmp := pin + "_new" // bpffs refuses dots in names
	// A leftover of an agent that died here would make pinning fail.
	if err := Detach(tmp); err != nil {
		return err
	}
	if err := l.Pin(tmp); err != nil {
		return err
	}
	if err := os.Rename(tmp, pin); err != nil {
		return errors.Join(fmt.Errorf("replace link pin %s: %w", pin, err), l.Unpin())
	}
	return nil
}

// isFirst reports whether l is the first TCX ingress link of ifindex.
func isFirst(ifindex int, l link.Link) (bool, error) {
	info, err := l.Info()
	if err != nil {
		return false, err
	}
	res, err := link.QueryPrograms(link.QueryOptions{Target: ifindex, Attach: ebpf.AttachTCXIngress})
	if err != nil {
		return false, fmt.Errorf("query TCX ingress of ifindex %d: %w", ifindex, err)
	}
	if len(res.Programs) == 0 {
		return false, nil
	}
	id, ok := res.Programs[0].LinkID()
	return ok && id == info.ID, nil
}

// Detach releases the link pinned at pin, which detaches its program. A
// missing pin is not an error.
func Detach(pin string) error {
	l, err := link.LoadPinnedLink(pin, nil)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		// Not a link (or unreadable): the pin still has to go.
		return errors.Join(err, os.Remove(pin))
	}
	defer l.Close()
	return l.Unpin()
}

// LinkInfo describes a pinned TCX link.
type LinkInfo struct {
	// Ifindex is 0 once the device is gone.
	Ifindex int
	Program ebpf.ProgramID
	First   bool
}

// PinnedLink reads the link pinned at pin. First is only meaningful when
// the calling thread is in the device's network namespace.
func PinnedLink(pin string) (LinkInfo, error) {
	l, err := link.LoadPinnedLink(pin, nil)
	if err != nil {
		return LinkInfo{}, err
	}
	defer l.Close()
	info, err := l.Info()
	if err != nil {
		return LinkInfo{}, err
	}
	if info.TCX() == nil {
		return LinkInfo{}, fmt.Errorf("%s: not a TCX link", pin)
	}
	li := LinkInfo{Ifindex: int(info.TCX().Ifindex), Program: info.Program}
	if li.Ifindex != 0 {
		li.First, _ = isFirst(li.Ifindex, l)
	}
	return li, nil
}
