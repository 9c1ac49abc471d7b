// SPDX-License-Identifier: Apache-2.0

package netnstest

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// Addresses of the topology. Node i (1 or 2) has pod ranges 10.i.0.0/24 and
// fd00:i::/64 and uplink addresses 192.168.100.i and fd00:ffff::i. Pods
// use 169.254.1.1 (on the node's loopback) and fe80::1 (on their host-side
// interface) as gateways.
const (
	UplinkName = "up0"
	podGW4     = "169.254.1.1"
	podGW6     = "fe80::1"
	agentTable = 100
)

// Node is a network namespace standing in for a Kubernetes node.
type Node struct {
	*NS
	Index int
	// Uplink is the interface towards the other node (named UplinkName).
	Uplink netlink.Link
	// Tunnel is the node's tunnel device (NewTunnelNodes), or nil.
	Tunnel       netlink.Link
	Addr4, Addr6 netip.Addr
	pods         int
}

// Pod is a network namespace behind a veth pair on its node, as a CNI
// plugin sets it up: eth0 inside, HostIf on the node.
type Pod struct {
	*NS
	Name     string
	Node     *Node
	IP4, IP6 netip.Addr
	// HostIf and HostIndex name the host-side interface in the node.
	HostIf    string
	HostIndex int
	// MAC is the address of eth0 inside the pod.
	MAC net.HardwareAddr
}

// NewNodes creates two nodes joined by a veth pair between their uplinks,
// each routing the other's pod ranges over it (Cilium's native routing).
func NewNodes(t testing.TB) (*Node, *Node) { return newNodes(t, "", false) }

// Tunnel is a protocol of Cilium's tunnel routing mode.
type Tunnel string

const (
	TunnelVXLAN  Tunnel = "vxlan"
	TunnelGeneve Tunnel = "geneve"
	// TunnelWireGuard stands for Cilium's WireGuard in native routing:
	// each node routes the other's pod ranges through an L3 device
	// (cilium_wg0, a tun here), whose packets a relay carries between the
	// uplinks as UDP on WireGuard's port, and writes into the other node's
	// device, where they arrive as WireGuard decrypts them. Unencrypted:
	// the kernel may lack WireGuard, and the device is what is tested.
	TunnelWireGuard Tunnel = "wg0"
)

// Device is the name Cilium gives the tunnel's device.
func (p Tunnel) Device() string { return "cilium_" + string(p) }

// NewTunnelNodes is NewNodes in Cilium's tunnel routing mode: each node
// routes the other's pod ranges through its tunnel device (Node.Tunnel),
// so that pods' packets cross the uplinks only encapsulated, on Cilium's
// UDP port for the protocol, and arrive decapsulated on the other node's
// tunnel device. Cilium's devices carry the peer in each packet's
// metadata (BPF sets it); these name their one peer instead.
func NewTunnelNodes(t testing.TB, protocol Tunnel) (*Node, *Node) {
	return newNodes(t, protocol, false)
}

// NewTunnelNodesOverWireGuard is NewTunnelNodes with Cilium's WireGuard
// under the tunnel: the tunnel's packets go between the nodes' WireGuard
// addresses (10.254.0.i) through cilium_wg0, relayed as TunnelWireGuard's,
// so that the uplinks carry only WireGuard's UDP and the tunnel's packets
// arrive on cilium_wg0 before they are decapsulated on the tunnel device.
func NewTunnelNodesOverWireGuard(t testing.TB, protocol Tunnel) (*Node, *Node) {
	return newNodes(t, protocol, true)
}

// wireGuardAddr is node i's address on cilium_wg0 under a tunnel.
func wireGuardAddr(index int) netip.Addr {
	return netip.MustParseAddr(fmt.Sprintf("10.254.0.%d", index))
}

// wireGuardOverhead is what the relay adds on the uplink (outer IPv4 and
// UDP; WireGuard would add its 32 bytes too).
const wireGuardOverhead = 60

// Tunnel addresses: node i has 10.255.0.i/24 and fd00:fffe::i/64 on its
// tunnel device, the next hop of the other node's pod ranges.
func tunnelAddrs(index int) (netip.Addr, netip.Addr) {
	return netip.MustParseAddr(fmt.Sprintf("10.255.0.%d", index)), netip.MustParseAddr(fmt.Sprintf("fd00:fffe::%d", index))
}

// tunnelOverhead is what encapsulation adds (outer IPv4, UDP, VXLAN or
// Geneve without options, inner Ethernet): the uplinks get that much more
// MTU, so that pods keep 1500.
const tunnelOverhead = 50

func newNodes(t testing.TB, tunnel Tunnel, overWireGuard bool) (*Node, *Node) {
	t.Helper()
	a, b := newNode(t, 1), newNode(t, 2)
	la := &netlink.Veth{
		LinkAttrs:     netlink.LinkAttrs{Name: UplinkName},
		PeerName:      UplinkName,
		PeerNamespace: netlink.NsFd(b.Handle),
	}
	must(t, a.Netlink(t).LinkAdd(la))
	for _, n := range []*Node{a, b} {
		h := n.Netlink(t)
		l, err := h.LinkByName(UplinkName)
		must(t, err)
		n.Uplink = l
		switch {
		case overWireGuard:
			must(t, h.LinkSetMTU(l, 1500+tunnelOverhead+wireGuardOverhead))
		case tunnel != "":
			must(t, h.LinkSetMTU(l, 1500+tunnelOverhead))
		}
		must(t, h.LinkSetUp(l))
	}
	for _, n := range []*Node{a, b} {
		h := n.Netlink(t)
		waitOperUp(t, h, n.Uplink)
		addAddr(t, n.NS, h, n.Uplink, n.Addr4, 24)
		addAddr(t, n.NS, h, n.Uplink, n.Addr6, 64)
	}
	route := func(from, to *Node) {
		h := from.Netlink(t)
		via4, via6, dev := to.Addr4, to.Addr6, from.Uplink
		if tunnel != "" {
			via4, via6 = tunnelAddrs(to.Index)
			dev = from.Tunnel
		}
		for _, r := range []struct {
			dst string
			gw  netip.Addr
		}{{fmt.Sprintf("10.%d.0.0/24", to.Index), via4}, {fmt.Sprintf("fd00:%d::/64", to.Index), via6}} {
			_, dst, _ := net.ParseCIDR(r.dst)
			must(t, h.RouteAdd(&netlink.Route{Dst: dst, Gw: r.gw.AsSlice(), LinkIndex: dev.Attrs().Index}))
		}
	}
	if overWireGuard {
		addWireGuardUnderlay(t, a, b)
		addWireGuardUnderlay(t, b, a)
	}
	if tunnel != "" {
		addTunnel(t, a, b, tunnel, overWireGuard)
		addTunnel(t, b, a, tunnel, overWireGuard)
	}
	route(a, b)
	route(b, a)
	return a, b
}

// addWireGuardUnderlay gives n cilium_wg0 towards peer (relayL3), with
// n's WireGuard address, for a tunnel over it.
func addWireGuardUnderlay(t testing.TB, n, peer *Node) {
	t.Helper()
	name := TunnelWireGuard.Device()
	relayL3(t, n, peer, name)
	h := n.Netlink(t)
	l, err := h.LinkByName(name)
	must(t, err)
	must(t, h.LinkSetMTU(l, 1500+tunnelOverhead))
	must(t, h.LinkSetUp(l))
	addAddr(t, n.NS, h, l, wireGuardAddr(n.Index), 24)
}

// addTunnel gives n its tunnel device towards peer, with n's tunnel
// addresses; overWireGuard, between the nodes' WireGuard addresses.
func addTunnel(t testing.TB, n, peer *Node, protocol Tunnel, overWireGuard bool) {
	t.Helper()
	attrs := netlink.LinkAttrs{Name: protocol.Device(), MTU: 1500}
	local, remote, underlay := n.Addr4, peer.Addr4, n.Uplink.Attrs().Index
	if overWireGuard {
		local, remote, underlay = wireGuardAddr(n.Index), wireGuardAddr(peer.Index), 0
	}
	var l netlink.Link
	switch protocol {
	case TunnelVXLAN:
		l = &netlink.Vxlan{LinkAttrs: attrs, VxlanId: 2, SrcAddr: local.AsSlice(), Group: remote.AsSlice(),
			Port: 8472, VtepDevIndex: underlay}
	case TunnelGeneve:
		l = &netlink.Geneve{LinkAttrs: attrs, ID: 2, Remote: remote.AsSlice(), Dport: 6081}
	case TunnelWireGuard:
		relayL3(t, n, peer, attrs.Name)
	default:
		t.Fatalf("tunnel protocol %q: want %q, %q or %q", protocol, TunnelVXLAN, TunnelGeneve, TunnelWireGuard)
	}
	h := n.Netlink(t)
	if l != nil { // the relay's tun device exists already
		if err := h.LinkAdd(l); errors.Is(err, unix.EOPNOTSUPP) {
			t.Skipf("add %s: %v: this kernel has no %s devices", attrs.Name, err, protocol)
		} else {
			must(t, wrap(err, "add %s", attrs.Name))
		}
	}
	l, err := h.LinkByName(attrs.Name)
	must(t, err)
	must(t, h.LinkSetUp(l)) // its operational state stays unknown
	n.Tunnel = l
	addr4, addr6 := tunnelAddrs(n.Index)
	addAddr(t, n.NS, h, l, addr4, 24)
	addAddr(t, n.NS, h, l, addr6, 64)
}

// wireGuardPort is the UDP port of Cilium's WireGuard device.
const wireGuardPort = 51871

// relayL3 gives n a tun device named name, and relays: what n routes into
// the device goes to peer's uplink address as UDP, and what comes from
// there is written into the device, which receives it.
func relayL3(t testing.TB, n, peer *Node, name string) {
	t.Helper()
	var (
		tun  *os.File
		conn *net.UDPConn
	)
	must(t, n.Do(func() (err error) {
		if tun, err = OpenTun(name); err != nil {
			return err
		}
		conn, err = net.ListenUDP("udp4", &net.UDPAddr{IP: n.Addr4.AsSlice(), Port: wireGuardPort})
		return err
	}))
	t.Cleanup(func() { tun.Close(); conn.Close() })
	to := &net.UDPAddr{IP: peer.Addr4.AsSlice(), Port: wireGuardPort}
	// Both end when the test closes the device and the socket.
	go func() {
		buf := make([]byte, 1<<16)
		for {
			k, err := tun.Read(buf)
			if err != nil {
				return
			}
			conn.WriteToUDP(buf[:k], to)
		}
	}()
	go func() {
		buf := make([]byte, 1<<16)
		for {
			k, _, err := conn.ReadFromUDP(buf)
			if err != nil {
				return
			}
			tun.Write(buf[:k])
		}
	}()
}

// OpenTun creates a tun device (L3: no Ethernet header, no packet
// information) in the calling thread's network namespace. Writing an IP
// packet to the file makes the device receive it; reading gets what is
// routed into the device.
func OpenTun(name string) (*os.File, error) {
	fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return nil, wrap(err, "open /dev/net/tun")
	}
	ifr, err := unix.NewIfreq(name)
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	ifr.SetUint16(unix.IFF_TUN | unix.IFF_NO_PI)
	if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
		unix.Close(fd)
		return nil, wrap(err, "create tun device %s", name)
	}
	// Non-blocking: the runtime's poller reads it, and Close wakes it.
	return os.NewFile(uintptr(fd), "tun:"+name), nil
}

func newNode(t testing.TB, index int) *Node {
	n := &Node{
		NS:    NewNS(t, fmt.Sprintf("mtlsb-node%d", index)),
		Index: index,
		Addr4: netip.MustParseAddr(fmt.Sprintf("192.168.100.%d", index)),
		Addr6: netip.MustParseAddr(fmt.Sprintf("fd00:ffff::%d", index)),
	}
	for name, v := range map[string]string{
		"ipv4/ip_forward":                     "1",
		"ipv6/conf/all/forwarding":            "1",
		"ipv6/conf/default/accept_dad":        "0",
		"ipv4/conf/all/rp_filter":             "0",
		"ipv4/conf/default/rp_filter":         "0",
		"ipv6/conf/default/keep_addr_on_down": "1",
	} {
		n.Sysctl(t, name, v)
	}
	h := n.Netlink(t)
	lo, err := h.LinkByName("lo")
	must(t, err)
	addAddr(t, n.NS, h, lo, netip.MustParseAddr(podGW4), 32)
	return n
}

// AddPod creates a pod on the node with the next free addresses.
func (n *Node) AddPod(t testing.TB, name string) *Pod {
	t.Helper()
	n.pods++
	p := &Pod{
		NS:     NewNS(t, "mtlsb-"+name),
		Name:   name,
		Node:   n,
		IP4:    netip.MustParseAddr(fmt.Sprintf("10.%d.0.%d", n.Index, 9+n.pods)),
		IP6:    netip.MustParseAddr(fmt.Sprintf("fd00:%d::%d", n.Index, 9+n.pods)),
		HostIf: truncate("lxc"+name, unix.IFNAMSIZ-1),
	}
	p.Sysctl(t, "ipv6/conf/default/accept_dad", "0")
	p.Sysctl(t, "ipv4/conf/default/rp_filter", "0")
	p.Sysctl(t, "ipv4/conf/all/rp_filter", "0")

	nh := n.Netlink(t)
	must(t, nh.LinkAdd(&netlink.Veth{
		LinkAttrs:     netlink.LinkAttrs{Name: p.HostIf},
		PeerName:      "eth0",
		PeerNamespace: netlink.NsFd(p.Handle),
	}))
	host, err := nh.LinkByName(p.HostIf)
	must(t, err)
	p.HostIndex = host.Attrs().Index
	must(t, nh.LinkSetUp(host))
	for _, ip := range []netip.Addr{p.IP4, p.IP6} {
		must(t, nh.RouteAdd(&netlink.Route{Dst: HostPrefix(ip), LinkIndex: p.HostIndex, Scope: netlink.SCOPE_LINK}))
	}

	ph := p.Netlink(t)
	eth0, err := ph.LinkByName("eth0")
	must(t, err)
	p.MAC = eth0.Attrs().HardwareAddr
	must(t, ph.LinkSetUp(eth0))
	waitOperUp(t, nh, host)
	waitOperUp(t, ph, eth0)
	addAddr(t, n.NS, nh, host, netip.MustParseAddr(podGW6), 64)
	addAddr(t, p.NS, ph, eth0, p.IP4, 32)
	addAddr(t, p.NS, ph, eth0, p.IP6, 128)
	gw4 := netip.MustParseAddr(podGW4)
	must(t, ph.RouteAdd(&netlink.Route{Dst: HostPrefix(gw4), LinkIndex: eth0.Attrs().Index, Scope: netlink.SCOPE_LINK}))
	must(t, ph.RouteAdd(&netlink.Route{Gw: gw4.AsSlice(), LinkIndex: eth0.Attrs().Index}))
	must(t, ph.RouteAdd(&netlink.Route{Gw: net.ParseIP(podGW6), LinkIndex: eth0.Attrs().Index}))
	return p
}

// MakeAgent sets the pod up as an mTLS agent captures traffic with TPROXY:
// every packet arriving on eth0 is delivered locally whatever its
// destination, so that transparent listeners (Listen with transparent)
// accept connections addressed to other pods, and transparent sockets
// (DialFrom) receive the replies to connections made in a pod's name.
func (p *Pod) MakeAgent(t testing.TB) {
	t.Helper()
	h := p.Netlink(t)
	lo, err := h.LinkByName("lo")
	must(t, err)
	for _, family := range []int{unix.AF_INET, unix.AF_INET6} {
		rule := netlink.NewRule()
		rule.Family = family
		rule.IifName = "eth0"
		rule.Table = agentTable
		rule.Priority = 100
		must(t, h.RuleAdd(rule))
		dst := &net.IPNet{IP: net.IPv4zero, Mask: net.CIDRMask(0, 32)}
		if family == unix.AF_INET6 {
			dst = &net.IPNet{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}
		}
		must(t, h.RouteAdd(&netlink.Route{Dst: dst, LinkIndex: lo.Attrs().Index, Table: agentTable, Type: unix.RTN_LOCAL, Scope: netlink.SCOPE_HOST}))
	}
}

// Remove deletes the pod's veth pair, as a CNI plugin does when the pod goes.
func (p *Pod) Remove(t testing.TB) {
	t.Helper()
	h := p.Node.Netlink(t)
	l, err := h.LinkByName(p.HostIf)
	must(t, err)
	must(t, h.LinkDel(l))
}

// waitOperUp waits until the kernel has taken the link up (its link-watch
// worker has seen the carrier), before routes go over it. That can take up
// to a second: the kernel batches a carrier change it does not count as
// urgent, such as that of a veth whose two ends have the same index (the
// uplink: the first link of each node's fresh namespace), or any while
// other links change. With the uplinks' routes added before, the first
// IPv6 connection between the nodes lost its first SYN in 9 runs of 10,
// sometimes the retransmitted one too, and failed a test that gives a
// connection two seconds; with the pods' routes, the first connection lost
// one while other tests changed links.
func waitOperUp(t testing.TB, h *netlink.Handle, l netlink.Link) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		now, err := h.LinkByIndex(l.Attrs().Index)
		must(t, err)
		if now.Attrs().OperState == netlink.OperUp {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s not up after 5s: %s", l.Attrs().Name, now.Attrs().OperState)
		}
		time.Sleep(time.Millisecond)
	}
}

// addAddr adds ip/bits to l with h, ns's handle. An IPv6 address is usable only once the
// kernel has joined its solicited-node group: until then a neighbour
// solicitation for it is dropped, and the first packet to it waits a second
// for the next one. The kernel joins in its DAD work (even with NODAD), on a
// workqueue that takes the RTNL lock, so while other tests hold that lock
// (tearing namespaces down) the join comes late.
func addAddr(t testing.TB, ns *NS, h *netlink.Handle, l netlink.Link, ip netip.Addr, bits int) {
	t.Helper()
	addr := &netlink.Addr{IPNet: &net.IPNet{IP: ip.AsSlice(), Mask: net.CIDRMask(bits, ip.BitLen())}}
	if ip.Is6() {
		addr.Flags = unix.IFA_F_NODAD
	}
	must(t, wrap(h.AddrAdd(l, addr), "add %s/%d to %s", ip, bits, l.Attrs().Name))
	// A device without neighbour discovery (NOARP: a tun) joins no group.
	if ip.Is6() && l.Attrs().RawFlags&unix.IFF_NOARP == 0 {
		waitSolicitedNodeGroup(t, ns, l, ip)
	}
}

// waitSolicitedNodeGroup waits until /proc/net/igmp6 of ns lists the
// solicited-node group of ip (ff02::1:ffXX:XXXX) on l.
func waitSolicitedNodeGroup(t testing.TB, ns *NS, l netlink.Link, ip netip.Addr) {
	t.Helper()
	a := ip.As16()
	group := fmt.Sprintf("ff0200000000000000000001ff%02x%02x%02x", a[13], a[14], a[15])
	ifindex := strconv.Itoa(l.Attrs().Index)
	deadline := time.Now().Add(5 * time.Second)
	for {
		var groups []byte
		must(t, ns.Do(func() (err error) {
			groups, err = os.ReadFile("/proc/thread-self/net/igmp6")
			return err
		}))
		for line := range strings.Lines(string(groups)) {
			if f := strings.Fields(line); len(f) >= 3 && f[0] == ifindex && f[2] == group {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s on %s: solicited-node group not joined after 5s", ip, l.Attrs().Name)
		}
		time.Sleep(time.Millisecond)
	}
}

// HostPrefix is ip alone as a prefix (/32, /128), for routes and rules.
func HostPrefix(ip netip.Addr) *net.IPNet {
	return &net.IPNet{IP: ip.AsSlice(), Mask: net.CIDRMask(ip.BitLen(), ip.BitLen())}
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n]
	}
	return s
}
