// SPDX-License-Identifier: Apache-2.0

package inpod

import (
	"fmt"
	"net/netip"
	"os"
	"runtime"
	"slices"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/mtlsbridge/mtlsbridge/zds"
)

// openPodNetns opens the network namespace at path (from the pod's CNI
// report) and checks that it is one, that it is not the node's (nothing of
// the redirection may ever land there: it would capture the node's TCP),
// and, when ips is given, that it holds every one of the pod's addresses.
// The caller closes the file.
//
// Possible errors: one wrapping os.ErrNotExist (the sandbox is gone),
// zds.ErrNotNetns, ErrNodeNetns, ErrWrongNetns.
func openPodNetns(path string, ips []netip.Addr) (*os.File, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	if err := checkPodNetns(f, ips); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

func checkPodNetns(f *os.File, ips []netip.Addr) error {
	if err := zds.CheckNetns(f); err != nil {
		return err
	}
	id, err := netnsID(netns.NsHandle(f.Fd()))
	if err != nil {
		return err
	}
	own, err := ownNetns()
	if err != nil {
		return err
	}
	if own == id {
		return fmt.Errorf("%w: %s is the agent's own", ErrNodeNetns, f.Name())
	}
	// PID 1's is the node's when the agent sees the node's processes. When
	// the agent is PID 1, that is its main thread's (see ownNetns).
	if os.Getpid() != 1 {
		if pid1, err := statNetns("/proc/1/ns/net"); err == nil && pid1 == id {
			return fmt.Errorf("%w: %s is PID 1's", ErrNodeNetns, f.Name())
		}
	}
	if len(ips) == 0 {
		return nil
	}
	have, err := netnsAddrs(netns.NsHandle(f.Fd()))
	if err != nil {
		return err
	}
	for _, ip := range ips {
		if !slices.Contains(have, ip.Unmap()) {
			return fmt.Errorf("%w: %s does not hold %s", ErrWrongNetns, f.Name(), ip)
		}
	}
	return nil
}

// netnsAddrs lists the addresses of the namespace ns.
func netnsAddrs(ns netns.NsHandle) ([]netip.Addr, error) {
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		return nil, err
	}
	defer h.Close()
	addrs, err := h.AddrList(nil, netlink.FAMILY_ALL)
	if err != nil {
		return nil, err
	}
	have := make([]netip.Addr, 0, len(addrs))
	for _, a := range addrs {
		if ip, ok := netip.AddrFromSlice(a.IP); ok {
			have = append(have, ip.Unmap())
		}
	}
	return have, nil
}

// ownNetns identifies the agent's own network namespace. It is read on a
// thread locked for the purpose, not from /proc/self, which is the main
// thread's: libraries that open a netlink socket in a pod's namespace
// (netlink.NewHandleAt, nftables) move their thread there for a moment,
// and that may be the main thread, which would make the pod's namespace
// look like the node's. They keep the thread locked until it is back (or
// the runtime discards it), so a thread locked here is in the agent's
// namespace. Not for a caller on a thread it moved to another namespace.
func ownNetns() (NetnsID, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	id, err := statNetns("/proc/thread-self/ns/net")
	if err != nil {
		// %v: this is no sign that the pod's namespace is gone.
		return NetnsID{}, fmt.Errorf("the agent's own network namespace: %v", err)
	}
	return id, nil
}

// inPodNetns opens the pod's namespace and runs fn with its handle.
func inPodNetns(path string, ips []netip.Addr, fn func(netns.NsHandle) error) error {
	f, err := openPodNetns(path, ips)
	if err != nil {
		return err
	}
	defer f.Close()
	return fn(netns.NsHandle(f.Fd()))
}
