// SPDX-License-Identifier: Apache-2.0

package inpod

import (
	"fmt"
	"net/netip"
	"os"
	"slices"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

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
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return err
	}
	for _, node := range []string{"/proc/self/ns/net", "/proc/1/ns/net"} {
		var ns unix.Stat_t
		if unix.Stat(node, &ns) == nil && ns.Dev == st.Dev && ns.Ino == st.Ino {
			return fmt.Errorf("%w: %s is %s", ErrNodeNetns, f.Name(), node)
		}
	}
	if len(ips) == 0 {
		return nil
	}
	h, err := netlink.NewHandleAt(netns.NsHandle(f.Fd()))
	if err != nil {
		return err
	}
	defer h.Close()
	addrs, err := h.AddrList(nil, netlink.FAMILY_ALL)
	if err != nil {
		return err
	}
	var have []netip.Addr
	for _, a := range addrs {
		if ip, ok := netip.AddrFromSlice(a.IP); ok {
			have = append(have, ip.Unmap())
		}
	}
	for _, ip := range ips {
		if !slices.Contains(have, ip.Unmap()) {
			return fmt.Errorf("%w: %s does not hold %s", ErrWrongNetns, f.Name(), ip)
		}
	}
	return nil
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
