// SPDX-License-Identifier: Apache-2.0

package tables

import (
	"errors"
	"fmt"
	"net/netip"
)

// ErrNotPodAddr: an address no pod can have.
var ErrNotPodAddr = errors.New("not a pod address")

// PodAddr checks an address reported for a pod (by the API or the CNI
// plugin) and returns it in its one canonical form: IPv4 as IPv4, never
// IPv4-mapped IPv6. Every input goes through it: two spellings of one
// address would be two rows for one entry of the redirect map, and the
// rows' owners would take turns at it. Unspecified (the key of the mTLS
// agent's entry), loopback, multicast and zoned addresses are refused.
func PodAddr(a netip.Addr) (netip.Addr, error) {
	a = a.Unmap()
	switch {
	case !a.IsValid():
		return a, fmt.Errorf("%w: invalid", ErrNotPodAddr)
	case a.Zone() != "":
		return a, fmt.Errorf("%w: zoned", ErrNotPodAddr)
	case a.IsUnspecified():
		return a, fmt.Errorf("%w: unspecified", ErrNotPodAddr)
	case a.IsLoopback():
		return a, fmt.Errorf("%w: loopback", ErrNotPodAddr)
	case a.IsMulticast():
		return a, fmt.Errorf("%w: multicast", ErrNotPodAddr)
	}
	return a, nil
}

// ParsePodAddr parses and checks an address of a pod (see PodAddr).
func ParsePodAddr(s string) (netip.Addr, error) {
	a, err := netip.ParseAddr(s)
	if err != nil {
		return netip.Addr{}, fmt.Errorf("%w: not an IP address", ErrNotPodAddr)
	}
	return PodAddr(a)
}
