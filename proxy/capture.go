// SPDX-License-Identifier: Apache-2.0

package proxy

// Capture: how connections reach the proxy's listeners.
//
// The node's BPF programs hand the proxy's network namespace, on its eth0,
// packets whose IP header is untouched: an enrolled pod's TCP to another
// node (from-pod), HBONE to a local enrolled pod's port 15008 and replies
// to connections the proxy holds (node-ingress). None is addressed to the
// proxy. The capture makes the namespace accept them as its own and hand
// each to the right socket, keeping the original destination as the
// socket's local address:
//
//	table inet mtlsbridge-proxy, chain prerouting (filter, priority mangle):
//	  iifname eth0, destination is local (fib daddr type local)  -> accept, untouched
//	                (xDS, CA, health, metrics: the proxy's own traffic)
//	  iifname eth0, TCP of a transparent socket (socket transparent 1)
//	                -> mark, accept   (replies to connections made in a pod's name)
//	  iifname eth0, TCP dport 15008 -> tproxy to 127.0.0.1:15008 / [::1]:15008, mark
//	  iifname eth0, TCP other ports -> tproxy to 127.0.0.1:15001 / [::1]:15001, mark
//	chain forward (filter): iifname eth0 -> drop
//	ip rule fwmark MARK/MASK lookup TABLE;  TABLE: local 0.0.0.0/0 dev lo, local ::/0 dev lo
//
// The mark makes the routing decision local; TPROXY assigns the packet to
// an established socket of the flow if there is one, else to the listener.
// The listeners are on loopback: nothing reaches them except through TPROXY.
// When no listener is there (the proxy died), TPROXY finds no socket, the
// packet is not marked, is not local, and the forward chain drops it: an
// enrolled pod's connection fails instead of leaving in clear, whatever
// the namespace's forwarding setting.
//
// Why TPROXY rather than sk_lookup (a BPF program choosing the socket):
//   - no BPF object to build, load and pin in the proxy: the node agent
//     owns the project's BPF, and a proxy image needs no clang nor bpffs;
//   - connections already established (replies to the proxy's transparent
//     connections) are found by TPROXY's own socket lookup, where
//     sk_lookup only sees new connections and would still need policy
//     routing for the rest;
//   - it is nftables driven through netlink (github.com/google/nftables),
//     no iptables or nft binary, the same library the in-pod mode will use
//     to write the redirection into pods' namespaces.

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// Defaults of the capture. The mark and mask are those of ztunnel's
// shared-node mode (TPROXY mark 0x400/0xfff); the table is free in a
// proxy's namespace.
const (
	DefaultCaptureTable    = "mtlsbridge-proxy"
	DefaultCaptureIface    = "eth0"
	DefaultCaptureMark     = 0x400
	DefaultCaptureMask     = 0xfff
	DefaultRouteTable      = 133
	DefaultRulePriority    = 32764
	captureChain           = "prerouting"
	captureForwardChain    = "forward"
	ifnameSize             = unix.IFNAMSIZ
	loopbackV4             = "127.0.0.1"
	loopbackV6             = "::1"
	captureOutboundPort    = OutboundPort
	captureHBONEListenPort = HBONEPort
)

// CaptureOptions place the capture; zero values take the defaults.
type CaptureOptions struct {
	// Netns is the namespace to capture in; 0 is the caller's own.
	Netns        netns.NsHandle
	Interface    string
	Table        string
	Mark, Mask   uint32
	RouteTable   int
	RulePriority int
	// OutboundPort and HBONEPort are the loopback listeners' ports.
	OutboundPort, HBONEPort uint16
}

func (o CaptureOptions) withDefaults() CaptureOptions {
	if o.Interface == "" {
		o.Interface = DefaultCaptureIface
	}
	if o.Table == "" {
		o.Table = DefaultCaptureTable
	}
	if o.Mark == 0 {
		o.Mark, o.Mask = DefaultCaptureMark, DefaultCaptureMask
	}
	if o.Mask == 0 {
		o.Mask = 0xffffffff
	}
	if o.RouteTable == 0 {
		o.RouteTable = DefaultRouteTable
	}
	if o.RulePriority == 0 {
		o.RulePriority = DefaultRulePriority
	}
	if o.OutboundPort == 0 {
		o.OutboundPort = captureOutboundPort
	}
	if o.HBONEPort == 0 {
		o.HBONEPort = captureHBONEListenPort
	}
	return o
}

// Capture is an installed capture.
type Capture struct {
	opts CaptureOptions
}

// Table is the nftables table's name.
func (c *Capture) Table() string { return c.opts.Table }

// InstallCapture writes the capture into the namespace, replacing a
// previous one of the same table name (a restarted proxy), in one
// nftables transaction; the rule and routes are added if missing.
func InstallCapture(opts CaptureOptions) (*Capture, error) {
	opts = opts.withDefaults()
	c := &Capture{opts: opts}
	conn, err := c.nft()
	if err != nil {
		return nil, err
	}
	if err := c.writeRuleset(conn); err != nil {
		return nil, fmt.Errorf("nftables: %w", err)
	}
	if err := c.routing(true); err != nil {
		return nil, errors.Join(err, c.Remove())
	}
	return c, nil
}

// Remove deletes the table, rules and routes; missing ones are fine.
func (c *Capture) Remove() error {
	conn, err := c.nft()
	if err != nil {
		return err
	}
	var errs []error
	if exists, err := c.tableExists(conn); err != nil {
		errs = append(errs, err)
	} else if exists {
		conn.DelTable(&nftables.Table{Name: c.opts.Table, Family: nftables.TableFamilyINet})
		errs = append(errs, conn.Flush())
	}
	errs = append(errs, c.routing(false))
	return errors.Join(errs...)
}

func (c *Capture) nft() (*nftables.Conn, error) {
	if c.opts.Netns != 0 {
		return nftables.New(nftables.WithNetNSFd(int(c.opts.Netns)))
	}
	return nftables.New()
}

func (c *Capture) tableExists(conn *nftables.Conn) (bool, error) {
	tables, err := conn.ListTablesOfFamily(nftables.TableFamilyINet)
	if err != nil {
		return false, err
	}
	return slices.ContainsFunc(tables, func(t *nftables.Table) bool { return t.Name == c.opts.Table }), nil
}

// writeRuleset replaces the table atomically.
func (c *Capture) writeRuleset(conn *nftables.Conn) error {
	exists, err := c.tableExists(conn)
	if err != nil {
		return err
	}
	table := &nftables.Table{Name: c.opts.Table, Family: nftables.TableFamilyINet}
	if exists {
		conn.DelTable(table)
	}
	conn.AddTable(table)
	accept := nftables.ChainPolicyAccept
	chain := conn.AddChain(&nftables.Chain{
		Name: captureChain, Table: table, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookPrerouting, Priority: nftables.ChainPriorityMangle, Policy: &accept,
	})
	// add appends one rule made of the parts, in order.
	add := func(parts ...[]expr.Any) {
		conn.AddRule(&nftables.Rule{Table: table, Chain: chain, Exprs: slices.Concat(parts...)})
	}
	accepted := []expr.Any{&expr.Verdict{Kind: expr.VerdictAccept}}
	iif := c.iifname()
	// Traffic to the namespace's own addresses is the proxy's own.
	add(iif, []expr.Any{
		&expr.Fib{Register: 1, FlagDADDR: true, ResultADDRTYPE: true},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.NativeEndian.PutUint32(unix.RTN_LOCAL)},
	}, accepted)
	// Packets of a transparent socket's connection: delivered locally.
	add(iif, tcp(), []expr.Any{
		&expr.Socket{Key: expr.SocketKeyTransparent, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{1}},
	}, c.setMark(), accepted)
	// HBONE, then everything else, per family.
	for _, family := range []struct {
		nfproto byte
		addr    netip.Addr
	}{{unix.NFPROTO_IPV4, netip.MustParseAddr(loopbackV4)}, {unix.NFPROTO_IPV6, netip.MustParseAddr(loopbackV6)}} {
		proto := []expr.Any{
			&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{family.nfproto}},
		}
		dport := func(op expr.CmpOp) []expr.Any {
			return []expr.Any{
				&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
				&expr.Cmp{Op: op, Register: 1, Data: binaryutil.BigEndian.PutUint16(c.opts.HBONEPort)},
			}
		}
		add(iif, proto, tcp(), dport(expr.CmpOpEq), c.tproxy(family.nfproto, family.addr, c.opts.HBONEPort))
		add(iif, proto, tcp(), dport(expr.CmpOpNeq), c.tproxy(family.nfproto, family.addr, c.opts.OutboundPort))
	}
	// Nothing arriving on the interface is ever forwarded: what the
	// capture did not take (no proxy listening) is dropped even where the
	// namespace has forwarding on.
	drop := nftables.ChainPolicyAccept
	forward := conn.AddChain(&nftables.Chain{
		Name: captureForwardChain, Table: table, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookForward, Priority: nftables.ChainPriorityFilter, Policy: &drop,
	})
	conn.AddRule(&nftables.Rule{Table: table, Chain: forward, Exprs: slices.Concat(iif, []expr.Any{&expr.Verdict{Kind: expr.VerdictDrop}})})
	return conn.Flush()
}

// iifname matches the captured interface.
func (c *Capture) iifname() []expr.Any {
	name := make([]byte, ifnameSize)
	copy(name, c.opts.Interface)
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: name},
	}
}

func tcp() []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.IPPROTO_TCP}},
	}
}

// setMark sets the packet mark (the whole mark: nothing else in the
// proxy's namespace marks packets).
func (c *Capture) setMark() []expr.Any {
	return []expr.Any{
		&expr.Immediate{Register: 1, Data: binaryutil.NativeEndian.PutUint32(c.opts.Mark)},
		&expr.Meta{Key: expr.MetaKeyMARK, SourceRegister: true, Register: 1},
	}
}

// tproxy assigns the packet to a socket at addr:port (or its established
// socket) and marks it; if TPROXY finds no socket the rule stops there and
// the packet is neither marked nor accepted here.
func (c *Capture) tproxy(nfproto byte, addr netip.Addr, port uint16) []expr.Any {
	return append([]expr.Any{
		&expr.Immediate{Register: 1, Data: addr.AsSlice()},
		&expr.Immediate{Register: 2, Data: binaryutil.BigEndian.PutUint16(port)},
		&expr.TProxy{Family: nfproto, TableFamily: byte(nftables.TableFamilyINet), RegAddr: 1, RegPort: 2},
	}, append(c.setMark(), &expr.Verdict{Kind: expr.VerdictAccept})...)
}

// routing adds (or removes) the policy routing that delivers marked
// packets locally, for both families.
func (c *Capture) routing(add bool) error {
	h, err := c.netlink()
	if err != nil {
		return err
	}
	defer h.Close()
	lo, err := h.LinkByName("lo")
	if err != nil {
		return err
	}
	var errs []error
	for _, family := range []int{unix.AF_INET, unix.AF_INET6} {
		rule := netlink.NewRule()
		rule.Family = family
		rule.Mark = c.opts.Mark
		rule.Mask = &c.opts.Mask
		rule.Table = c.opts.RouteTable
		rule.Priority = c.opts.RulePriority
		dst := &net.IPNet{IP: net.IPv4zero.To4(), Mask: net.CIDRMask(0, 32)}
		if family == unix.AF_INET6 {
			dst = &net.IPNet{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}
		}
		route := &netlink.Route{Dst: dst, LinkIndex: lo.Attrs().Index, Table: c.opts.RouteTable,
			Type: unix.RTN_LOCAL, Scope: netlink.SCOPE_HOST, Family: family}
		if add {
			if err := h.RuleAdd(rule); err != nil && !errors.Is(err, unix.EEXIST) {
				errs = append(errs, fmt.Errorf("ip rule fwmark %#x lookup %d: %w", c.opts.Mark, c.opts.RouteTable, err))
			}
			if err := h.RouteReplace(route); err != nil {
				errs = append(errs, fmt.Errorf("local %s dev lo table %d: %w", dst, c.opts.RouteTable, err))
			}
			continue
		}
		if err := h.RuleDel(rule); err != nil && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("delete ip rule: %w", err))
		}
		if err := h.RouteDel(route); err != nil && !errors.Is(err, unix.ESRCH) && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("delete local route: %w", err))
		}
	}
	return errors.Join(errs...)
}

func (c *Capture) netlink() (*netlink.Handle, error) {
	if c.opts.Netns != 0 {
		return netlink.NewHandleAt(c.opts.Netns)
	}
	return netlink.NewHandle()
}
