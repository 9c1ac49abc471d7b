// SPDX-License-Identifier: Apache-2.0

// Package bpf holds the datapath of CFP-32759: the C programs (redirect.c),
// their bpf2go bindings, loading with the map pinned under the agent's bpffs
// folder, TCX attachment through pinned links, and a typed view of the
// redirect map. It decides nothing: reconcilers/redirect says what goes in.
package bpf

import (
	"errors"
	"fmt"
	"net"
	"path/filepath"

	"github.com/cilium/ebpf"
)

// MapName is the redirect map's pin name under the bpffs root.
const MapName = "redirect_map"

// ProxiedMapName is the pin name of the connections from-pod handed to an
// agent (an LRU map the programs write; its entries are not for operators).
const ProxiedMapName = "proxied_map"

// MapPins are the paths of every map pinned under the bpffs root.
func MapPins(root string) []string {
	return []string{filepath.Join(root, MapName), filepath.Join(root, ProxiedMapName)}
}

// Objects are the loaded programs and the redirect map.
type Objects struct {
	// FromPod runs at TCX ingress of local pods' host-side interfaces.
	FromPod *ebpf.Program
	// NodeIngress runs at TCX ingress of the node's uplinks, and
	// NodeIngressL3 there on devices without an Ethernet header.
	NodeIngress, NodeIngressL3 *ebpf.Program
	// Redirects is the map both programs read.
	Redirects *RedirectMap

	objs redirectObjects
	// spare holds second instances of the programs: TCX refuses the same
	// program twice on one device, and Attach needs two links for a moment.
	spare redirectPrograms
}

// Load loads the programs. With root set, the maps are the ones pinned at
// root/redirect_map and root/proxied_map, reused with their entries when
// they exist and pinned there otherwise: a restarted agent keeps steering
// without a gap.
// root must have been prepared with PrepareRoot. With root empty, the map is
// private to the returned objects (tests, benchmarks).
//
// Possible errors: ErrUnsafePin when the pinned map is writable by others
// than root; an error wrapping ebpf.ErrMapIncompatible when the pinned map
// has another layout (a newer or older agent); ebpf.VerifierError; a
// permission error without CAP_BPF.
func Load(root string) (*Objects, error) {
	spec, err := loadRedirect()
	if err != nil {
		return nil, err
	}
	opts := &ebpf.CollectionOptions{}
	if root == "" {
		for _, m := range spec.Maps {
			m.Pinning = ebpf.PinNone
		}
	} else {
		for _, pin := range MapPins(root) {
			if err := checkPinOwner(pin); err != nil {
				return nil, err
			}
		}
		opts.Maps.PinPath = root
	}
	o := &Objects{}
	if err := spec.LoadAndAssign(&o.objs, opts); err != nil {
		return nil, fmt.Errorf("load redirect programs: %w", err)
	}
	spareOpts := &ebpf.CollectionOptions{MapReplacements: map[string]*ebpf.Map{
		MapName: o.objs.RedirectMap, ProxiedMapName: o.objs.ProxiedMap,
	}}
	if err := spec.LoadAndAssign(&o.spare, spareOpts); err != nil {
		o.objs.Close()
		return nil, fmt.Errorf("load redirect programs (spare): %w", err)
	}
	o.FromPod = o.objs.FromPod
	o.NodeIngress, o.NodeIngressL3 = o.objs.NodeIngress, o.objs.NodeIngressL3
	o.Redirects = &RedirectMap{m: o.objs.RedirectMap}
	return o, nil
}

// Close releases the file descriptors. Pinned objects stay, and with them
// the attached programs and the map entries.
func (o *Objects) Close() error { return errors.Join(o.objs.Close(), o.spare.Close()) }

// programs returns the program of a hook for interface ifindex (resolved
// in the calling thread's network namespace) and its spare instance.
func (o *Objects) programs(h Hook, ifindex int) (prog, spare *ebpf.Program, err error) {
	switch h {
	case HookFromPod:
		return o.objs.FromPod, o.spare.FromPod, nil
	case HookNodeIngress:
		iface, err := net.InterfaceByIndex(ifindex)
		if err != nil {
			return nil, nil, fmt.Errorf("interface %d: %w", ifindex, err)
		}
		// An Ethernet device (loopback's address is zeros) has a 6-byte
		// address; WireGuard and tun devices have none, IP tunnels an IP.
		if len(iface.HardwareAddr) != 6 {
			return o.objs.NodeIngressL3, o.spare.NodeIngressL3, nil
		}
		return o.objs.NodeIngress, o.spare.NodeIngress, nil
	}
	return nil, nil, fmt.Errorf("hook %q: %w", h, ErrUnknownHook)
}
