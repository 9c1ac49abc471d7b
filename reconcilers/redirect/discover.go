// SPDX-License-Identifier: Apache-2.0

package redirect

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/mtlsbridge/mtlsbridge/nodenetns"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/steering"
)

// PodInterface is the host side of a pod's veth pair.
type PodInterface struct {
	Name  string
	Index int
	// MAC is the address of the peer, inside the pod.
	MAC net.HardwareAddr
	// NetnsID names the pod's network namespace as the node sees it.
	NetnsID int32
}

// Scan is a snapshot of the node's interfaces.
type Scan struct {
	// Pods maps every address configured on the peer of a veth pair to
	// the host side of the pair.
	Pods map[netip.Addr]PodInterface
	// Devices maps every interface name of the node to its index.
	Devices map[string]int
	// Uplinks are the devices that look like the node's uplinks (see
	// findUplinks), looked for when --devices is not given; UplinksFound
	// says the search succeeded.
	Uplinks      []string
	UplinksFound bool
	// Local are the node's own global addresses (uplinks, cilium_host,
	// ...): traffic to them is same-node.
	Local []netip.Addr
	// Claimed maps an address found behind several veths (a pod with
	// NET_ADMIN configured another's) to their host-side names. Such an
	// address is not in Pods: no claimant is believed.
	Claimed map[netip.Addr][]string
}

// add records that the veth iface has addr on its peer.
func (s *Scan) add(addr netip.Addr, iface PodInterface) {
	if names, claimed := s.Claimed[addr]; claimed {
		if !slices.Contains(names, iface.Name) {
			s.Claimed[addr] = append(names, iface.Name)
		}
		return
	}
	if first, ok := s.Pods[addr]; ok && first.Index != iface.Index {
		delete(s.Pods, addr)
		if s.Claimed == nil {
			s.Claimed = map[netip.Addr][]string{}
		}
		s.Claimed[addr] = []string{first.Name, iface.Name}
		return
	}
	s.Pods[addr] = iface
}

// Interfaces finds pods' interfaces and the node's devices. The cell
// provides the netlink implementation; tests may provide another.
type Interfaces interface {
	// Scan lists the node's interfaces. A partial scan comes back with an
	// error naming what could not be read.
	Scan() (Scan, error)
	// Changed is closed at the next change of the node's links or routes.
	Changed() <-chan struct{}
}

// netlinkInterfaces reads the node's veth pairs and, through each pair's
// peer namespace id (IFLA_LINK_NETNSID), the addresses and MAC inside the
// pod, without entering the pod. This finds a pod whatever the routing
// (Cilium routes pods through cilium_host unless endpoint routes are on),
// and an address counts only where it is really configured.
type netlinkInterfaces struct {
	netns         *nodenetns.Namespace
	detectUplinks bool

	mu      sync.Mutex
	changed chan struct{}
}

type interfacesParams struct {
	cell.In

	Config Config
	Mode   steering.Config `optional:"true"`
	Netns  *nodenetns.Namespace
	Jobs   job.Group
}

func newNetlinkInterfaces(p interfacesParams) Interfaces {
	ni := &netlinkInterfaces{netns: p.Netns, detectUplinks: len(p.Config.Devices) == 0, changed: make(chan struct{})}
	if p.Config.EnableRedirect && !inactive(p.Mode) { // else nothing scans: the derivation knows
		p.Jobs.Add(job.OneShot("watch-interfaces", ni.watch))
	}
	return ni
}

func (ni *netlinkInterfaces) Changed() <-chan struct{} {
	ni.mu.Lock()
	defer ni.mu.Unlock()
	return ni.changed
}

func (ni *netlinkInterfaces) signal() {
	ni.mu.Lock()
	defer ni.mu.Unlock()
	close(ni.changed)
	ni.changed = make(chan struct{})
}

// watch follows link and route changes of the node until ctx ends.
func (ni *netlinkInterfaces) watch(ctx context.Context, health cell.Health) error {
	for ctx.Err() == nil {
		err := ni.subscribe(ctx)
		if ctx.Err() != nil {
			break
		}
		health.Degraded("netlink subscription lost", err)
		ni.signal() // changes may have been missed
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
		}
	}
	return nil
}

func (ni *netlinkInterfaces) subscribe(ctx context.Context) error {
	done := make(chan struct{})
	defer close(done)
	links := make(chan netlink.LinkUpdate, 64)
	routes := make(chan netlink.RouteUpdate, 64)
	errc := make(chan error, 2)
	onErr := func(err error) {
		select {
		case errc <- err:
		default:
		}
	}
	ns := ni.netns.Handle()
	if err := netlink.LinkSubscribeWithOptions(links, done, netlink.LinkSubscribeOptions{Namespace: &ns, ErrorCallback: onErr}); err != nil {
		return fmt.Errorf("subscribe to links: %w", err)
	}
	if err := netlink.RouteSubscribeWithOptions(routes, done, netlink.RouteSubscribeOptions{Namespace: &ns, ErrorCallback: onErr}); err != nil {
		return fmt.Errorf("subscribe to routes: %w", err)
	}
	for {
		select {
		case <-ctx.Done():
			return nil
		case err := <-errc:
			return err
		case _, ok := <-links:
			if !ok {
				return errors.New("link updates closed")
			}
			ni.signal()
		case _, ok := <-routes:
			if !ok {
				return errors.New("route updates closed")
			}
			ni.signal()
		}
	}
}

func (ni *netlinkInterfaces) Scan() (Scan, error) {
	var (
		s   Scan
		err error
	)
	if derr := ni.netns.Do(func() error { s, err = scan(ni.detectUplinks); return nil }); derr != nil {
		return Scan{}, derr
	}
	return s, err
}

// scanAttempts bounds the retries of a scan whose netlink dumps were
// interrupted: interfaces came or went meanwhile (pods starting and going),
// and the kernel marks such a dump possibly inconsistent.
const scanAttempts = 5

// scan runs in the node's namespace; detectUplinks: look for the devices
// that look like uplinks (no --devices).
func scan(detectUplinks bool) (Scan, error) {
	for attempt := 1; ; attempt++ {
		s, err := scanOnce(detectUplinks)
		if !errors.Is(err, netlink.ErrDumpInterrupted) || attempt == scanAttempts {
			return s, err
		}
	}
}

func scanOnce(detectUplinks bool) (Scan, error) {
	s := Scan{Pods: map[netip.Addr]PodInterface{}, Devices: map[string]int{}}
	links, err := netlink.LinkList()
	if err != nil {
		return s, fmt.Errorf("list links: %w", err)
	}
	own, err := netlink.AddrList(nil, netlink.FAMILY_ALL)
	if err != nil {
		return s, fmt.Errorf("list addresses: %w", err)
	}
	addrs := map[int]linkAddrs{}
	for _, a := range own {
		addr, ok := netip.AddrFromSlice(a.IP)
		if ok && a.Scope == unix.RT_SCOPE_UNIVERSE {
			s.Local = append(s.Local, addr.Unmap())
		}
		if a.Flags&(unix.IFA_F_TENTATIVE|unix.IFA_F_DADFAILED) == 0 {
			la := addrs[a.LinkIndex]
			la.any = true
			la.global = la.global || ok && addr.Unmap().IsGlobalUnicast()
			addrs[a.LinkIndex] = la
		}
	}
	var errs []error
	if detectUplinks {
		s.Uplinks, err = findUplinks(links, addrs)
		s.UplinksFound = err == nil
		errs = append(errs, err)
	}
	sock, err := nl.GetNetlinkSocketAt(netns.None(), netns.None(), unix.NETLINK_ROUTE)
	if err != nil {
		return s, err
	}
	defer sock.Close()
	// Strict checking makes the kernel honour the target namespace and
	// the interface filter of address dumps.
	if err := unix.SetsockoptInt(sock.GetFd(), unix.SOL_NETLINK, unix.NETLINK_GET_STRICT_CHK, 1); err != nil {
		return s, err
	}
	sockets := map[int]*nl.SocketHandle{unix.NETLINK_ROUTE: {Socket: sock}}

	for _, l := range links {
		a := l.Attrs()
		s.Devices[a.Name] = a.Index
		if l.Type() != "veth" || a.NetNsID < 0 {
			continue
		}
		addrs, err := peerAddrs(sockets, a.NetNsID, a.ParentIndex)
		if err != nil {
			errs = append(errs, fmt.Errorf("addresses behind %s: %w", a.Name, err))
			continue
		}
		if len(addrs) == 0 {
			continue
		}
		mac, err := peerMAC(sockets, a.NetNsID, a.ParentIndex)
		if err != nil {
			errs = append(errs, fmt.Errorf("peer of %s: %w", a.Name, err))
			continue
		}
		for _, addr := range addrs {
			s.add(addr, PodInterface{Name: a.Name, Index: a.Index, MAC: mac, NetnsID: int32(a.NetNsID)})
		}
	}
	return s, errors.Join(errs...)
}

// peerAddrs lists the global addresses of interface index in the
// namespace nsid.
func peerAddrs(sockets map[int]*nl.SocketHandle, nsid, index int) ([]netip.Addr, error) {
	req := nl.NewNetlinkRequest(unix.RTM_GETADDR, unix.NLM_F_DUMP)
	req.Sockets = sockets
	msg := nl.NewIfAddrmsg(unix.AF_UNSPEC)
	msg.Index = uint32(index)
	req.AddData(msg)
	req.AddData(nl.NewRtAttr(unix.IFA_TARGET_NETNSID, nl.Uint32Attr(uint32(nsid))))
	msgs, err := req.Execute(unix.NETLINK_ROUTE, unix.RTM_NEWADDR)
	if err != nil {
		return nil, err
	}
	var out []netip.Addr
	for _, m := range msgs {
		am := nl.DeserializeIfAddrmsg(m)
		if int(am.Index) != index || am.Scope != unix.RT_SCOPE_UNIVERSE {
			continue
		}
		attrs, err := nl.ParseRouteAttr(m[am.Len():])
		if err != nil {
			return nil, err
		}
		// IFA_LOCAL is the interface's own IPv4 address (IFA_ADDRESS may be
		// the peer's on point-to-point links); IPv6 has IFA_ADDRESS only.
		var local, address []byte
		for _, attr := range attrs {
			switch attr.Attr.Type {
			case unix.IFA_LOCAL:
				local = attr.Value
			case unix.IFA_ADDRESS:
				address = attr.Value
			}
		}
		if local == nil {
			local = address
		}
		if addr, ok := netip.AddrFromSlice(local); ok {
			out = append(out, addr.Unmap())
		}
	}
	return out, nil
}

// peerMAC reads the MAC of interface index in the namespace nsid.
func peerMAC(sockets map[int]*nl.SocketHandle, nsid, index int) (net.HardwareAddr, error) {
	req := nl.NewNetlinkRequest(unix.RTM_GETLINK, unix.NLM_F_ACK)
	req.Sockets = sockets
	msg := nl.NewIfInfomsg(unix.AF_UNSPEC)
	msg.Index = int32(index)
	req.AddData(msg)
	req.AddData(nl.NewRtAttr(unix.IFLA_TARGET_NETNSID, nl.Uint32Attr(uint32(nsid))))
	msgs, err := req.Execute(unix.NETLINK_ROUTE, 0)
	if err != nil {
		return nil, err
	}
	if len(msgs) != 1 {
		return nil, fmt.Errorf("%d answers for one link", len(msgs))
	}
	l, err := netlink.LinkDeserialize(nil, msgs[0])
	if err != nil {
		return nil, err
	}
	if len(l.Attrs().HardwareAddr) != 6 {
		return nil, fmt.Errorf("peer %s has no Ethernet address", l.Attrs().Name)
	}
	return l.Attrs().HardwareAddr, nil
}
