// SPDX-License-Identifier: Apache-2.0

package redirect

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/mtlsbridge/mtlsbridge/api"
	"github.com/mtlsbridge/mtlsbridge/bpf"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/steering"
)

// nodeIngress returns the node-ingress attachments: HBONE from other
// nodes arrives on the uplinks (native routing) or, decapsulated, on
// Cilium's tunnel devices (tunnel routing).
//   - --devices names the uplinks; a name ending in + stands for every
//     device it prefixes, as in Cilium's devices. A name that matches
//     nothing has a row with a problem. Without --devices, the devices
//     that look like uplinks (Scan.Uplinks) are taken, and stay taken
//     while they exist: an address or route that comes and goes must
//     not detach the program while peers still send.
//   - Each of --tunnel-devices that exists is taken.
//
// kept are the devices with node-ingress now (device -> ifindex). When
// the scan could not list the node's links, they stand for the devices:
// each keeps its program as it is, in a row with a problem (which leaves
// the kernel alone and keeps the link from being pruned).
func nodeIngress(cfg Config, scan Scan, kept map[string]int) []*Attachment {
	var out []*Attachment
	add := func(device string, ifindex int, problem string) {
		out = append(out, &Attachment{Device: device, Ifindex: ifindex, Hook: bpf.HookNodeIngress, Problem: problem})
	}
	devices, problem := scan.Devices, ""
	linksListed := len(scan.Devices) > 0
	if !linksListed {
		devices, problem = kept, "links not listed: kept as attached"
	}
	for _, pattern := range cfg.Devices {
		if strings.HasPrefix(pattern, "!") {
			add(pattern, 0, fmt.Sprintf("--devices %s: exclusions are not supported; name the uplinks", pattern))
			continue
		}
		matched := false
		for name, idx := range devices {
			if matchDevice(pattern, name) {
				add(name, idx, problem)
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
		for dev, idx := range kept {
			switch {
			case !mayBeUplink(dev) || slices.Contains(cfg.TunnelDevices, dev):
			case !linksListed:
				add(dev, idx, problem)
			case scan.Devices[dev] != idx:
				// Gone, or another device under its name.
			case scan.UplinksFound:
				add(dev, idx, "") // found before, still there
			default:
				add(dev, idx, "uplinks not found: kept as attached")
			}
		}
	}
	for _, dev := range cfg.TunnelDevices {
		if idx, ok := devices[dev]; ok {
			add(dev, idx, problem)
		}
	}
	return out
}

// ErrNoNodeIngress: no device has the node-ingress program (none found, or
// every one named is missing). HBONE from other nodes then reaches pods'
// own port 15008 and is refused: closed, but cross-node mTLS fails.
var ErrNoNodeIngress = errors.New("no uplink or tunnel device has the node-ingress program: HBONE from other nodes is not steered to the mTLS agent (native routing: set --devices)")

type nodeIngressParams struct {
	cell.In

	Mode        steering.Config `optional:"true"`
	DB          *statedb.DB
	Datapath    Datapath
	Attachments statedb.Table[*Attachment]
}

// checkNodeIngress warns in /healthz (check node-ingress) once the
// attachments are initialized and none is node-ingress without a problem.
// A warning: a cluster of one node needs none.
func checkNodeIngress(p nodeIngressParams) api.CheckOut {
	check := func() error {
		if inactive(p.Mode) || errors.Is(p.Datapath.Err(), ErrDisabled) {
			return nil
		}
		txn := p.DB.ReadTxn()
		if initialized, _ := p.Attachments.Initialized(txn); !initialized {
			return nil
		}
		for a := range p.Attachments.All(txn) {
			if a.Hook == bpf.HookNodeIngress && a.Problem == "" {
				return nil
			}
		}
		return ErrNoNodeIngress
	}
	return api.CheckOut{Check: api.Check{Name: "node-ingress", Warning: true, Err: check}}
}

// mayHaveNodeIngress tells whether this agent's link on the device may be
// a node-ingress link, by the device's name: a restarted agent that cannot
// list the node's links tells its links apart no other way.
func mayHaveNodeIngress(cfg Config, device string) bool {
	return slices.Contains(cfg.TunnelDevices, device) ||
		slices.ContainsFunc(cfg.Devices, func(p string) bool { return matchDevice(p, device) }) ||
		len(cfg.Devices) == 0 && mayBeUplink(device)
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

// linkAddrs is what a link's addresses in use tell detection.
type linkAddrs struct {
	any bool
	// global: one is a global unicast address, whose local route is a
	// route to a global destination.
	global bool
}

// findUplinks picks the links that look like the node's uplinks, by the
// rules of Cilium's own device detection (its devices left empty): up,
// with an address, a route to a global unicast destination in any table
// (the local route of a global address; for an unnumbered uplink, routes
// learned over it), no loopback, not a member of a bridge or bond (of a
// VRF it may be), no bridge, Open vSwitch or IPoIB device, a name that may
// be an uplink's, and a veth only with a default route in the main table
// (a node that is a container, as in kind). The routes are read only when
// a candidate needs them (a node with a full routing table and uplinks
// with global addresses never dumps it). It runs in the node's namespace.
func findUplinks(links []netlink.Link, addrs map[int]linkAddrs) ([]string, error) {
	typeOf := map[int]string{}
	for _, l := range links {
		typeOf[l.Attrs().Index] = l.Type()
	}
	var candidates []netlink.Link
	needRoutes := false
	for _, l := range links {
		a := l.Attrs()
		switch {
		case !addrs[a.Index].any, a.RawFlags&unix.IFF_UP == 0, a.RawFlags&(unix.IFF_LOOPBACK|unix.IFF_SLAVE) != 0,
			a.MasterIndex != 0 && typeOf[a.MasterIndex] != "vrf",
			slices.Contains([]string{"bridge", "openvswitch", "ipoib"}, l.Type()),
			!mayBeUplink(a.Name):
			continue
		}
		candidates = append(candidates, l)
		needRoutes = needRoutes || l.Type() == "veth" || !addrs[a.Index].global
	}
	globalRoute, defaultRoute := map[int]bool{}, map[int]bool{}
	if needRoutes {
		err := netlink.RouteListFilteredIter(netlink.FAMILY_ALL, &netlink.Route{Table: unix.RT_TABLE_UNSPEC}, netlink.RT_FILTER_TABLE,
			func(r netlink.Route) bool {
				hops := []int{r.LinkIndex}
				for _, hop := range r.MultiPath {
					hops = append(hops, hop.LinkIndex)
				}
				for _, link := range hops {
					if r.Dst == nil || r.Dst.IP.IsUnspecified() {
						defaultRoute[link] = defaultRoute[link] || r.Table == unix.RT_TABLE_MAIN
					} else if dst, ok := netip.AddrFromSlice(r.Dst.IP); ok && dst.Unmap().IsGlobalUnicast() {
						globalRoute[link] = true
					}
				}
				return true
			})
		if err != nil {
			return nil, fmt.Errorf("list routes: %w", err)
		}
	}
	var uplinks []string
	for _, l := range candidates {
		a := l.Attrs()
		if (addrs[a.Index].global || globalRoute[a.Index]) && (l.Type() != "veth" || defaultRoute[a.Index]) {
			uplinks = append(uplinks, a.Name)
		}
	}
	return uplinks, nil
}
