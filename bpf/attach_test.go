// SPDX-License-Identifier: Apache-2.0

package bpf_test

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"

	"github.com/mtlsbridge/mtlsbridge/bpf"
	"github.com/mtlsbridge/mtlsbridge/internal/netnstest"
)

// TestPinnedMapReused: a second Load (a restarted agent) gets the same map
// with its entries, and the pin is writable by root only; a pin others
// could write is refused.
func TestPinnedMapReused(t *testing.T) {
	netnstest.RequirePrivileged(t)
	root := filepath.Join(netnstest.BPFRoot(t), "agent")
	must(t, bpf.PrepareRoot(root))

	first, err := bpf.Load(root)
	must(t, err)
	must(t, first.Redirects.Update(podA, bpf.Entry{Kind: bpf.KindEnrolled, Ifindex: 11, MAC: podMAC, NetnsID: bpf.NoNetns}))
	first.Close()

	second, err := bpf.Load(root)
	must(t, err)
	defer second.Close()
	e, ok, err := second.Redirects.Lookup(podA)
	must(t, err)
	if !ok || e.Kind != bpf.KindEnrolled || e.Ifindex != 11 || e.MAC.String() != podMAC.String() {
		t.Fatalf("entry after reload: %v %v", ok, e)
	}

	pin := filepath.Join(root, bpf.MapName)
	info, err := os.Stat(pin)
	must(t, err)
	if info.Mode().Perm() != 0o600 {
		t.Fatalf("map pin mode %s, want -rw-------", info.Mode())
	}
	must(t, os.Chmod(pin, 0o666))
	if _, err := bpf.Load(root); !errors.Is(err, bpf.ErrUnsafePin) {
		t.Fatalf("load with a world-writable pin: %v, want ErrUnsafePin", err)
	}
	must(t, os.Chmod(root, 0o777))
	if err := bpf.PrepareRoot(root); !errors.Is(err, bpf.ErrUnsafePin) {
		t.Fatalf("prepare a world-writable root: %v, want ErrUnsafePin", err)
	}
}

// TestAttach: attaching is idempotent, keeps the program first in the TCX
// chain, swaps a new program in without detaching, and recovers from a
// device that was replaced.
func TestAttach(t *testing.T) {
	netnstest.RequirePrivileged(t)
	root := netnstest.BPFRoot(t)
	ns := netnstest.NewNS(t, "mtlsb-attach")
	h := ns.Netlink(t)
	newDevice := func() int {
		must(t, h.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "lxc0"}, PeerName: "peer0"}))
		l, err := h.LinkByName("lxc0")
		must(t, err)
		return l.Attrs().Index
	}
	ifindex := newDevice()
	pin := filepath.Join(root, "from-pod-lxc0")

	objs, err := bpf.Load("")
	must(t, err)
	defer objs.Close()
	attach := func(objs *bpf.Objects, ifindex int) {
		t.Helper()
		must(t, ns.Do(func() error { return objs.Attach(bpf.HookFromPod, pin, ifindex) }))
	}
	state := func() (bpf.LinkInfo, []link.AttachedProgram) {
		t.Helper()
		var (
			li  bpf.LinkInfo
			res *link.QueryResult
		)
		must(t, ns.Do(func() (err error) {
			if li, err = bpf.PinnedLink(pin); err != nil {
				return err
			}
			res, err = link.QueryPrograms(link.QueryOptions{Target: ifindex, Attach: ebpf.AttachTCXIngress})
			return err
		}))
		return li, res.Programs
	}
	progID := func(p *ebpf.Program) ebpf.ProgramID {
		info, err := p.Info()
		must(t, err)
		id, _ := info.ID()
		return id
	}

	// Step 1: attach, twice: one link, first, running FromPod.
	attach(objs, ifindex)
	li1, progs := state()
	attach(objs, ifindex)
	li2, progs2 := state()
	if !li1.First || li1.Ifindex != ifindex || li1.Program != progID(objs.FromPod) || len(progs) != 1 || len(progs2) != 1 || li2 != li1 {
		t.Fatalf("after attach: %+v %v; again: %+v %v", li1, progs, li2, progs2)
	}

	// Step 2: another program takes the head; attaching again puts ours
	// back in front and leaves exactly one of ours.
	var other link.Link
	must(t, ns.Do(func() (err error) {
		other, err = link.AttachTCX(link.TCXOptions{Interface: ifindex, Program: objs.NodeIngress, Attach: ebpf.AttachTCXIngress, Anchor: link.Head()})
		return err
	}))
	defer other.Close()
	if li, _ := state(); li.First {
		t.Fatal("still first after another program took the head")
	}
	attach(objs, ifindex)
	li, progs := state()
	if !li.First || len(progs) != 2 || progs[0].ID != progID(objs.FromPod) || progs[1].ID != progID(objs.NodeIngress) {
		t.Fatalf("after re-attach: %+v, programs %v", li, progs)
	}
	other.Close()

	// Step 3: a new agent's program is swapped into the same link.
	next, err := bpf.Load("")
	must(t, err)
	defer next.Close()
	attach(next, ifindex)
	if li3, progs := state(); li3.Program != progID(next.FromPod) || !li3.First || len(progs) != 1 {
		t.Fatalf("after upgrade: %+v, programs %v", li3, progs)
	}

	// Step 4: the device goes and comes back with another index.
	dev, err := h.LinkByName("lxc0")
	must(t, err)
	must(t, h.LinkDel(dev))
	if li, err := bpf.PinnedLink(pin); err != nil || li.Ifindex != 0 {
		t.Fatalf("link of a deleted device: %+v, %v", li, err)
	}
	ifindex = newDevice()
	attach(next, ifindex)
	if li, progs := state(); li.Ifindex != ifindex || !li.First || len(progs) != 1 {
		t.Fatalf("after the device came back: %+v, programs %v", li, progs)
	}

	// Step 5: detach, twice.
	must(t, bpf.Detach(pin))
	must(t, bpf.Detach(pin))
	if _, err := os.Stat(pin); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("pin after detach: %v", err)
	}
	if _, progs := stateNoPin(t, ns, ifindex); len(progs) != 0 {
		t.Fatalf("programs after detach: %v", progs)
	}
}

func stateNoPin(t *testing.T, ns *netnstest.NS, ifindex int) (struct{}, []link.AttachedProgram) {
	var res *link.QueryResult
	must(t, ns.Do(func() (err error) {
		res, err = link.QueryPrograms(link.QueryOptions{Target: ifindex, Attach: ebpf.AttachTCXIngress})
		return err
	}))
	return struct{}{}, res.Programs
}
