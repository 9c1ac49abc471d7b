// SPDX-License-Identifier: Apache-2.0

package redirect

import (
	"fmt"
	"slices"
	"strings"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/mtlsbridge/mtlsbridge/bpf"
)

// nodeIngress returns the node-ingress attachments: HBONE from other
// nodes arrives on the uplinks (native routing) or, decapsulated, on
// Cilium's tunnel devices (tunnel routing).
//   - --devices names the uplinks; a name ending in + stands for every
//     device it prefixes, as in Cilium's devices. A name that matches
//     nothing has a row with a problem. Without --devices, the devices
//     that look like uplinks (Scan.Uplinks) are taken.
//   - Each of --tunnel-devices that exists is taken.
//
// linked holds this agent's links when the scan could not list the node's
// links: those that may be node-ingress links stay as they are (a row with
// a problem leaves the kernel alone and keeps the link from being pruned).
func nodeIngress(cfg Config, scan Scan, linked map[string]int) []*Attachment {
	var out []*Attachment
	add := func(device string, ifindex int, problem string) {
		out = append(out, &Attachment{Device: device, Ifindex: ifindex, Hook: bpf.HookNodeIngress, Problem: problem})
	}
	for _, pattern := range cfg.Devices {
		matched := false
		for name, idx := range scan.Devices {
			if matchDevice(pattern, name) {
				add(name, idx, "")
				matched = true
			}
		}
		if !matched {
			add(pattern, 0, fmt.Sprintf("--devices %s: %v", pattern, ErrNoDevice))
		}
	}
	if len(cfg.Devices) == 0 {
		for _, dev := range scan.Uplinks {
			add(dev, scan.Devices[dev], "")
		}
	}
	for _, dev := range cfg.TunnelDevices {
		if idx, ok := scan.Devices[dev]; ok {
			add(dev, idx, "")
		}
	}
	for dev, idx := range linked {
		if slices.Contains(cfg.TunnelDevices, dev) || slices.ContainsFunc(cfg.Devices, func(p string) bool { return matchDevice(p, dev) }) ||
			len(cfg.Devices) == 0 && mayBeUplink(dev) {
			add(dev, idx, "links not listed: kept as attached")
		}
	}
	return out
}

// matchDevice tells whether a --devices entry names the device: its name,
// or a prefix of it followed by +.
func matchDevice(pattern, name string) bool {
	if prefix, ok := strings.CutSuffix(pattern, "+"); ok {
		return strings.HasPrefix(name, prefix)
	}
	return pattern == name
}

// mayBeUplink tells whether a device's name may be an uplink's: not
// Cilium's, a pod's, a CNI bridge's, Docker's or a loopback's.
func mayBeUplink(name string) bool {
	for _, prefix := range []string{"cilium_", "lxc", "cni", "docker", "lo"} {
		if strings.HasPrefix(name, prefix) {
			return false
		}
	}
	return true
}

// findUplinks picks the links that look like the node's uplinks, by the
// rules of Cilium's own device detection (its devices left empty): up,
// with a global address, no loopback, not a member of a bridge or bond (of
// a VRF it may be), no bridge, Open vSwitch or IPoIB device, a name that
// may be an uplink's, and a veth only with a default route (a node that is
// a container, as in kind). It runs in the node's namespace.
func findUplinks(links []netlink.Link, global map[int]bool) ([]string, error) {
	typeOf := map[int]string{}
	for _, l := range links {
		typeOf[l.Attrs().Index] = l.Type()
	}
	var defaultRoutes map[int]bool // read when a veth needs it
	var uplinks []string
	for _, l := range links {
		a := l.Attrs()
		switch {
		case !global[a.Index], a.RawFlags&unix.IFF_UP == 0, a.RawFlags&(unix.IFF_LOOPBACK|unix.IFF_SLAVE) != 0,
			a.MasterIndex != 0 && typeOf[a.MasterIndex] != "vrf",
			slices.Contains([]string{"bridge", "openvswitch", "ipoib"}, l.Type()),
			!mayBeUplink(a.Name):
			continue
		}
		if l.Type() == "veth" {
			if defaultRoutes == nil {
				var err error
				if defaultRoutes, err = linksWithDefaultRoute(); err != nil {
					return nil, err
				}
			}
			if !defaultRoutes[a.Index] {
				continue
			}
		}
		uplinks = append(uplinks, a.Name)
	}
	return uplinks, nil
}

// linksWithDefaultRoute lists the links of the main table's default routes.
func linksWithDefaultRoute() (map[int]bool, error) {
	out := map[int]bool{}
	for _, family := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
		// With the destination filter, a nil destination is the default.
		routes, err := netlink.RouteListFiltered(family, &netlink.Route{Table: unix.RT_TABLE_MAIN},
			netlink.RT_FILTER_DST|netlink.RT_FILTER_TABLE)
		if err != nil {
			return nil, fmt.Errorf("list default routes: %w", err)
		}
		for _, r := range routes {
			out[r.LinkIndex] = true
			for _, hop := range r.MultiPath {
				out[hop.LinkIndex] = true
			}
		}
	}
	return out, nil
}
