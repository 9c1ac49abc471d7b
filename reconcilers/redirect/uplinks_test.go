// SPDX-License-Identifier: Apache-2.0

package redirect

import (
	"net"
	"slices"
	"testing"

	"github.com/vishvananda/netlink"

	"github.com/mtlsbridge/mtlsbridge/internal/netnstest"
)

// TestScanFindsUplinks: in a namespace of the kernel, the scan takes for
// uplinks the devices that are up with an address and a route to a global
// destination (their own global address, or routes learned over a
// link-local one), and none of the devices that only look alike. (This
// kernel may lack bonds and VRFs: their members are not covered here.)
func TestScanFindsUplinks(t *testing.T) {
	netnstest.RequirePrivileged(t)
	ns := netnstest.NewNS(t, "mtlsb-uplinks")
	h := ns.Netlink(t)
	add := func(l netlink.Link, up bool, cidr string) netlink.Link {
		t.Helper()
		if err := h.LinkAdd(l); err != nil {
			t.Fatalf("add %s: %v", l.Attrs().Name, err)
		}
		l, err := h.LinkByName(l.Attrs().Name)
		if err != nil {
			t.Fatal(err)
		}
		if cidr != "" {
			addr, err := netlink.ParseAddr(cidr)
			if err != nil {
				t.Fatal(err)
			}
			if err := h.AddrAdd(l, addr); err != nil {
				t.Fatalf("address %s on %s: %v", cidr, l.Attrs().Name, err)
			}
		}
		if up {
			if err := h.LinkSetUp(l); err != nil {
				t.Fatal(err)
			}
		}
		return l
	}
	// ifb: a plain device (this kernel may have no dummy)
	device := func(name string) netlink.Link { return &netlink.Ifb{LinkAttrs: netlink.LinkAttrs{Name: name}} }
	veth := func(name string) netlink.Link {
		return &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: name}, PeerName: name + "p"}
	}

	add(device("eth0"), true, "192.0.2.1/24")
	add(device("eth1"), true, "2001:db8::1/64")
	add(device("eth2"), false, "192.0.2.2/24")  // down
	add(device("eth3"), true, "")               // no address
	add(device("eth4"), true, "169.254.7.1/16") // link-local only
	add(device("lxcpod"), true, "192.0.2.3/32") // a pod's name
	add(device("cilium_host"), true, "10.0.0.1/32")
	br := add(&netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "br0"}}, true, "192.0.2.4/24")
	member := add(device("eth5"), true, "192.0.2.5/24")
	if err := h.LinkSetMaster(member, br); err != nil {
		t.Fatal(err)
	}
	// Unnumbered: a link-local address, and routes learned over it.
	unnumbered := add(device("eth6"), true, "169.254.7.2/16")
	_, learned, _ := net.ParseCIDR("10.0.0.0/8")
	if err := h.RouteAdd(&netlink.Route{LinkIndex: unnumbered.Attrs().Index, Dst: learned}); err != nil {
		t.Fatal(err)
	}
	add(veth("veth0"), true, "192.0.2.6/24") // no default route
	kind := add(veth("veth1"), true, "198.51.100.2/24")
	if err := h.RouteAdd(&netlink.Route{LinkIndex: kind.Attrs().Index, Gw: net.ParseIP("198.51.100.1")}); err != nil {
		t.Fatal(err)
	}

	var s Scan
	if err := ns.Do(func() (err error) { s, err = scan(true); return err }); err != nil {
		t.Fatal(err)
	}
	slices.Sort(s.Uplinks)
	if want := []string{"eth0", "eth1", "eth6", "veth1"}; !s.UplinksFound || !slices.Equal(s.Uplinks, want) {
		t.Errorf("uplinks %v, want %v", s.Uplinks, want)
	}
}
