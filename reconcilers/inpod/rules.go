// SPDX-License-Identifier: Apache-2.0

package inpod

// The in-pod redirection: what ztunnel expects in each pod's network
// namespace (Istio's in-pod rules; Cilium v1.20 writes the same marks and
// ports), written through netlink: nftables (github.com/google/nftables)
// and policy routing (vishvananda/netlink). No iptables or nft binary.
//
//	table inet mtlsbridge-inpod
//	  chain prerouting-mangle (filter, prerouting, mangle):
//	    meta mark & 0xfff == 0x539 -> ct mark set ct mark & 0xfffff000 | 0x111
//	  chain output-mangle (route, output, mangle):
//	    ct mark & 0xfff == 0x111 -> meta mark set ct mark
//	  chain prerouting-nat (nat, prerouting, dstnat):
//	    tcp from the kubelet's probe address (169.254.7.127, fd16:9254:7127:1337:ffff:ffff:ffff:ffff) -> accept
//	    tcp not to 127.0.0.1 / ::1, dport != 15008, mark & 0xfff != 0x539 -> redirect :15006
//	  chain output-nat (nat, output, dstnat):
//	    tcp to the probe address -> accept
//	    tcp, mark & 0xfff == 0x111 -> accept
//	    oifname lo, not to 127.0.0.1 / ::1 -> accept
//	    tcp not to 127.0.0.1 / ::1, mark & 0xfff != 0x539 -> redirect :15001
//	ip rule priority 32764 fwmark 0x111/0xfff lookup 100 (IPv4 and IPv6)
//	ip route table 100: local 0.0.0.0/0 dev lo, local ::/0 dev lo
//
// ztunnel marks its own sockets 0x539: what it sends is never redirected,
// and its loopback connections to the pod (from the peer's address, as a
// transparent socket) mark the connection 0x111, so that the pod's
// replies are delivered back to ztunnel through table 100 instead of
// leaving. Everything else the pod sends or receives over TCP goes to
// ztunnel's listeners in the pod (15001 out, 15006 in plain, 15008 is
// HBONE itself); when no listener is there the connection is refused:
// fail closed.
//
// The table is written and replaced in one nftables transaction, so that a
// rewrite (an agent restart) never leaves a moment without it.

import (
	"bytes"
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

// What ztunnel expects; Istio's and Cilium's values.
const (
	// NFTTableName is the nftables table (family inet) of the redirection.
	NFTTableName = "mtlsbridge-inpod"
	// OutboundPort, InboundPlainPort, HBONEPort: ztunnel's listeners in the
	// pod.
	OutboundPort     = 15001
	InboundPlainPort = 15006
	HBONEPort        = 15008
	// ZtunnelMark is the mark ztunnel's own sockets carry (its
	// PACKET_MARK, 1337).
	ZtunnelMark = 0x539
	// ConnMark marks connections ztunnel made to the pod, whose replies
	// are delivered back to it.
	ConnMark = 0x111
	// MarkMask is the part of the marks the rules look at.
	MarkMask = 0xfff
	// RouteTable holds the local default routes; RulePriority is its ip
	// rule's.
	RouteTable   = 100
	RulePriority = 32764
)

// Kubelet probe addresses: the node SNATs its probes to them (istio-cni's
// HOST_PROBE_SNAT_IP defaults), so that they reach the pod without
// ztunnel.
var (
	ProbeSNAT4 = netip.MustParseAddr("169.254.7.127")
	ProbeSNAT6 = netip.MustParseAddr("fd16:9254:7127:1337:ffff:ffff:ffff:ffff")
)

// Chains of the table.
const (
	chainPreroutingMangle = "prerouting-mangle"
	chainOutputMangle     = "output-mangle"
	chainPreroutingNAT    = "prerouting-nat"
	chainOutputNAT        = "output-nat"
)

// chainSpec is a base chain and its rules.
type chainSpec struct {
	name     string
	typ      nftables.ChainType
	hook     *nftables.ChainHook
	priority *nftables.ChainPriority
	rules    [][]expr.Any
}

// ruleset is the desired content of the table.
func ruleset() []chainSpec {
	accept := []expr.Any{&expr.Verdict{Kind: expr.VerdictAccept}}
	redirect := func(port uint16) []expr.Any {
		return []expr.Any{
			&expr.Immediate{Register: 1, Data: binaryutil.BigEndian.PutUint16(port)},
			// As the kernel reads it back: a range of one port.
			&expr.Redir{RegisterProtoMin: 1, RegisterProtoMax: 1, Flags: unix.NF_NAT_RANGE_PROTO_SPECIFIED},
		}
	}
	v4, v6 := nfproto(unix.NFPROTO_IPV4), nfproto(unix.NFPROTO_IPV6)
	notLoopback4 := ipAddr(false, 16, netip.MustParseAddr("127.0.0.1"), expr.CmpOpNeq)
	notLoopback6 := ipAddr(true, 24, netip.IPv6Loopback(), expr.CmpOpNeq)
	return []chainSpec{
		{chainPreroutingMangle, nftables.ChainTypeFilter, nftables.ChainHookPrerouting, nftables.ChainPriorityMangle, [][]expr.Any{
			slices.Concat(markIs(expr.CmpOpEq, ZtunnelMark), []expr.Any{
				&expr.Ct{Key: expr.CtKeyMARK, Register: 1},
				&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4,
					Mask: native32(^uint32(MarkMask)), Xor: native32(ConnMark)},
				&expr.Ct{Key: expr.CtKeyMARK, Register: 1, SourceRegister: true},
			}),
		}},
		{chainOutputMangle, nftables.ChainTypeRoute, nftables.ChainHookOutput, nftables.ChainPriorityMangle, [][]expr.Any{
			slices.Concat(ctMarkIs(ConnMark), []expr.Any{
				&expr.Ct{Key: expr.CtKeyMARK, Register: 1},
				&expr.Meta{Key: expr.MetaKeyMARK, SourceRegister: true, Register: 1},
			}),
		}},
		{chainPreroutingNAT, nftables.ChainTypeNAT, nftables.ChainHookPrerouting, nftables.ChainPriorityNATDest, [][]expr.Any{
			slices.Concat(v4, tcp(), ipAddr(false, 12, ProbeSNAT4, expr.CmpOpEq), accept),
			slices.Concat(v6, tcp(), ipAddr(true, 8, ProbeSNAT6, expr.CmpOpEq), accept),
			slices.Concat(v4, notLoopback4, tcp(), dport(expr.CmpOpNeq, HBONEPort), markIs(expr.CmpOpNeq, ZtunnelMark), redirect(InboundPlainPort)),
			slices.Concat(v6, notLoopback6, tcp(), dport(expr.CmpOpNeq, HBONEPort), markIs(expr.CmpOpNeq, ZtunnelMark), redirect(InboundPlainPort)),
		}},
		{chainOutputNAT, nftables.ChainTypeNAT, nftables.ChainHookOutput, nftables.ChainPriorityNATDest, [][]expr.Any{
			slices.Concat(v4, tcp(), ipAddr(false, 16, ProbeSNAT4, expr.CmpOpEq), accept),
			slices.Concat(v6, tcp(), ipAddr(true, 24, ProbeSNAT6, expr.CmpOpEq), accept),
			slices.Concat(tcp(), markIs(expr.CmpOpEq, ConnMark), accept),
			slices.Concat(oifname("lo"), v4, notLoopback4, accept),
			slices.Concat(oifname("lo"), v6, notLoopback6, accept),
			slices.Concat(v4, notLoopback4, tcp(), markIs(expr.CmpOpNeq, ZtunnelMark), redirect(OutboundPort)),
			slices.Concat(v6, notLoopback6, tcp(), markIs(expr.CmpOpNeq, ZtunnelMark), redirect(OutboundPort)),
		}},
	}
}

func nfproto(p byte) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{p}},
	}
}

func tcp() []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.IPPROTO_TCP}},
	}
}

// ipAddr compares the address at offset of the network header (IPv4: 12
// source, 16 destination; IPv6: 8 and 24).
func ipAddr(v6 bool, offset uint32, a netip.Addr, op expr.CmpOp) []expr.Any {
	n := uint32(4)
	if v6 {
		n = 16
	}
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: offset, Len: n},
		&expr.Cmp{Op: op, Register: 1, Data: a.AsSlice()},
	}
}

func dport(op expr.CmpOp, port uint16) []expr.Any {
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
		&expr.Cmp{Op: op, Register: 1, Data: binaryutil.BigEndian.PutUint16(port)},
	}
}

// markIs compares the packet mark under MarkMask.
func markIs(op expr.CmpOp, mark uint32) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyMARK, Register: 1},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: native32(MarkMask), Xor: native32(0)},
		&expr.Cmp{Op: op, Register: 1, Data: native32(mark)},
	}
}

// ctMarkIs compares the connection mark under MarkMask.
func ctMarkIs(mark uint32) []expr.Any {
	return []expr.Any{
		&expr.Ct{Key: expr.CtKeyMARK, Register: 1},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: native32(MarkMask), Xor: native32(0)},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: native32(mark)},
	}
}

func oifname(name string) []expr.Any {
	b := make([]byte, unix.IFNAMSIZ)
	copy(b, name)
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyOIFNAME, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: b},
	}
}

func native32(v uint32) []byte { return binaryutil.NativeEndian.PutUint32(v) }

// Families of a pod's redirection: IPv6 policy routing only where the pod
// has an IPv6 address (a namespace may have IPv6 disabled).
type families struct{ v4, v6 bool }

func familiesOf(ips []netip.Addr) families {
	var f families
	for _, ip := range ips {
		if ip.Unmap().Is4() {
			f.v4 = true
		} else {
			f.v6 = true
		}
	}
	return f
}

func (f families) list() []int {
	var out []int
	if f.v4 {
		out = append(out, unix.AF_INET)
	}
	if f.v6 {
		out = append(out, unix.AF_INET6)
	}
	return out
}

// applyRules writes the redirection into the namespace h: the table,
// replaced in one transaction, then the rule and routes, added if missing.
func applyRules(h netns.NsHandle, fam families) error {
	conn, err := nftables.New(nftables.WithNetNSFd(int(h)))
	if err != nil {
		return err
	}
	table := &nftables.Table{Name: NFTTableName, Family: nftables.TableFamilyINet}
	if err := replaceTable(conn, table, nil, ruleset); err != nil {
		return fmt.Errorf("nftables: %w", err)
	}
	return routing(h, fam, true)
}

// replaceTable writes table anew in one transaction: deleted if it
// exists, added with its sets, then its chains and rules. chains is called
// once the sets are added, which gives them the IDs the rules' lookups
// name.
func replaceTable(conn *nftables.Conn, table *nftables.Table, sets []setSpec, chains func() []chainSpec) error {
	exists, err := tableExists(conn, table.Name)
	if err != nil {
		return err
	}
	if exists {
		conn.DelTable(table)
	}
	conn.AddTable(table)
	for _, s := range sets {
		if err := conn.AddSet(s.set, s.elements); err != nil {
			return err
		}
	}
	accept := nftables.ChainPolicyAccept
	for _, c := range chains() {
		chain := conn.AddChain(&nftables.Chain{Name: c.name, Table: table, Type: c.typ, Hooknum: c.hook, Priority: c.priority, Policy: &accept})
		for _, r := range c.rules {
			conn.AddRule(&nftables.Rule{Table: table, Chain: chain, Exprs: r})
		}
	}
	return conn.Flush()
}

// setSpec is a named set of a table and its elements.
type setSpec struct {
	set      *nftables.Set
	elements []nftables.SetElement
}

// removeRules deletes the table, the rule and the routes; what is missing
// is fine.
func removeRules(h netns.NsHandle) error {
	var errs []error
	conn, err := nftables.New(nftables.WithNetNSFd(int(h)))
	if err != nil {
		return err
	}
	if err := deleteTable(conn, &nftables.Table{Name: NFTTableName, Family: nftables.TableFamilyINet}); err != nil {
		errs = append(errs, fmt.Errorf("nftables: %w", err))
	}
	errs = append(errs, routing(h, families{true, true}, false))
	return errors.Join(errs...)
}

// deleteTable deletes table if it exists.
func deleteTable(conn *nftables.Conn, table *nftables.Table) error {
	exists, err := tableExists(conn, table.Name)
	if err != nil || !exists {
		return err
	}
	conn.DelTable(table)
	return conn.Flush()
}

// tableExists tells whether the inet table name exists.
func tableExists(conn *nftables.Conn, name string) (bool, error) {
	tables, err := conn.ListTablesOfFamily(nftables.TableFamilyINet)
	if err != nil {
		return false, err
	}
	return slices.ContainsFunc(tables, func(t *nftables.Table) bool { return t.Name == name }), nil
}

// policy routing of a family: the rule and the table's local route.
func policyRule(family int) *netlink.Rule {
	rule := netlink.NewRule()
	rule.Family = family
	rule.Mark = ConnMark
	mask := uint32(MarkMask)
	rule.Mask = &mask
	rule.Table = RouteTable
	rule.Priority = RulePriority
	return rule
}

func localRoute(family, lo int) *netlink.Route {
	dst := &net.IPNet{IP: net.IPv4zero.To4(), Mask: net.CIDRMask(0, 32)}
	if family == unix.AF_INET6 {
		dst = &net.IPNet{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}
	}
	return &netlink.Route{Dst: dst, LinkIndex: lo, Table: RouteTable, Type: unix.RTN_LOCAL, Scope: netlink.SCOPE_HOST, Family: family}
}

// routing adds (or removes) the rule and routes of the families.
func routing(h netns.NsHandle, fam families, add bool) error {
	nl, err := netlink.NewHandleAt(h)
	if err != nil {
		return err
	}
	defer nl.Close()
	lo, err := nl.LinkByName("lo")
	if err != nil {
		return err
	}
	var errs []error
	for _, family := range fam.list() {
		rule, route := policyRule(family), localRoute(family, lo.Attrs().Index)
		if add {
			if err := nl.RuleAdd(rule); err != nil && !errors.Is(err, unix.EEXIST) {
				errs = append(errs, fmt.Errorf("ip rule fwmark %#x/%#x lookup %d: %w", ConnMark, MarkMask, RouteTable, err))
			}
			if err := nl.RouteReplace(route); err != nil {
				errs = append(errs, fmt.Errorf("local %s dev lo table %d: %w", route.Dst, RouteTable, err))
			}
			continue
		}
		// Rules may have been added more than once (by hand): all go.
		for range 8 {
			if err := nl.RuleDel(rule); err != nil {
				if !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.EAFNOSUPPORT) {
					errs = append(errs, fmt.Errorf("delete ip rule: %w", err))
				}
				break
			}
		}
		if err := nl.RouteDel(route); err != nil && !errors.Is(err, unix.ESRCH) && !errors.Is(err, unix.ENOENT) &&
			!errors.Is(err, unix.EAFNOSUPPORT) {
			errs = append(errs, fmt.Errorf("delete local route: %w", err))
		}
	}
	return errors.Join(errs...)
}

// Gaps of the rules that checkRules reports (prefixes of the reasons).
const (
	GapTableMissing = "in-pod rules missing"
	GapTableAltered = "in-pod rules altered"
	GapRuleMissing  = "policy rule missing"
	GapRouteMissing = "local route of table 100 missing"
)

// checkRules reads the namespace and tells how it differs from what
// applyRules writes: each difference is a reason the pod's TCP may go
// around ztunnel. Nothing means the redirection is in place.
func checkRules(h netns.NsHandle, fam families) ([]string, error) {
	conn, err := nftables.New(nftables.WithNetNSFd(int(h)))
	if err != nil {
		return nil, err
	}
	var gaps []string
	exists, err := tableExists(conn, NFTTableName)
	if err != nil {
		return nil, fmt.Errorf("nftables: %w", err)
	}
	if !exists {
		gaps = append(gaps, GapTableMissing)
	} else {
		table := &nftables.Table{Name: NFTTableName, Family: nftables.TableFamilyINet}
		for _, diff := range diffTable(conn, table, ruleset()) {
			gaps = append(gaps, GapTableAltered+": "+diff)
		}
	}
	nl, err := netlink.NewHandleAt(h)
	if err != nil {
		return nil, err
	}
	defer nl.Close()
	for _, family := range fam.list() {
		name := map[int]string{unix.AF_INET: "IPv4", unix.AF_INET6: "IPv6"}[family]
		rules, err := nl.RuleList(family)
		if err != nil {
			return nil, err
		}
		found := slices.ContainsFunc(rules, func(r netlink.Rule) bool {
			return r.Table == RouteTable && r.Mark == ConnMark && r.Mask != nil && *r.Mask == MarkMask && r.Priority == RulePriority
		})
		if !found {
			gaps = append(gaps, fmt.Sprintf("%s (%s)", GapRuleMissing, name))
		}
		routes, err := nl.RouteListFiltered(family, &netlink.Route{Table: RouteTable}, netlink.RT_FILTER_TABLE)
		if err != nil {
			return nil, err
		}
		found = slices.ContainsFunc(routes, func(r netlink.Route) bool {
			if r.Type != unix.RTN_LOCAL {
				return false
			}
			if r.Dst == nil {
				return true
			}
			ones, _ := r.Dst.Mask.Size()
			return ones == 0
		})
		if !found {
			gaps = append(gaps, fmt.Sprintf("%s (%s)", GapRouteMissing, name))
		}
	}
	return gaps, nil
}

// GapNoListener: ztunnel holds no listener on one of its ports in the pod
// (ztunnel's word over ZDS aside, the pod's connections would be refused).
const GapNoListener = "no ztunnel listener in the pod on port"

// checkListeners looks for a listening TCP socket on each of ztunnel's
// ports in the namespace (sock_diag; either family).
func checkListeners(h netns.NsHandle) ([]string, error) {
	ports := []uint16{OutboundPort, InboundPlainPort, HBONEPort}
	listening, err := listeningPorts(h, ports)
	if err != nil {
		return nil, err
	}
	var gaps []string
	for _, port := range ports {
		if !listening[port] {
			gaps = append(gaps, fmt.Sprintf("%s %d", GapNoListener, port))
		}
	}
	return gaps, nil
}

// diffTable compares the table's chains and rules with want, by the
// netlink encoding of each rule's expressions.
func diffTable(conn *nftables.Conn, table *nftables.Table, want []chainSpec) []string {
	chains, err := conn.ListChainsOfTableFamily(nftables.TableFamilyINet)
	if err != nil {
		return []string{err.Error()}
	}
	have := map[string]*nftables.Chain{}
	for _, c := range chains {
		if c.Table.Name == table.Name {
			have[c.Name] = c
		}
	}
	var diffs []string
	for _, spec := range want {
		c := have[spec.name]
		delete(have, spec.name)
		switch {
		case c == nil:
			diffs = append(diffs, "chain "+spec.name+" missing")
			continue
		case c.Type != spec.typ || c.Hooknum == nil || *c.Hooknum != *spec.hook || c.Priority == nil || *c.Priority != *spec.priority ||
			(c.Policy != nil && *c.Policy != nftables.ChainPolicyAccept):
			diffs = append(diffs, "chain "+spec.name+" is not the base chain it was")
			continue
		}
		rules, err := conn.GetRules(table, c)
		if err != nil {
			diffs = append(diffs, fmt.Sprintf("chain %s: %v", spec.name, err))
			continue
		}
		if len(rules) != len(spec.rules) {
			diffs = append(diffs, fmt.Sprintf("chain %s has %d rules, want %d", spec.name, len(rules), len(spec.rules)))
			continue
		}
		for i, r := range rules {
			if !sameExprs(r.Exprs, spec.rules[i]) {
				diffs = append(diffs, fmt.Sprintf("chain %s: rule %d differs", spec.name, i+1))
			}
		}
	}
	for name := range have {
		diffs = append(diffs, "unexpected chain "+name)
	}
	slices.Sort(diffs)
	return diffs
}

func sameExprs(a, b []expr.Any) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		a[i] = readBack(a[i])
		x, err1 := expr.Marshal(byte(nftables.TableFamilyINet), a[i])
		y, err2 := expr.Marshal(byte(nftables.TableFamilyINet), b[i])
		if err1 != nil || err2 != nil || !bytes.Equal(x, y) {
			return false
		}
	}
	return true
}

// readBack undoes what github.com/google/nftables v0.3.0 loses when it
// decodes a rule: a ct expression that sets (NFTA_CT_SREG) comes back
// with no register at all, which only a set can (a load has a
// destination).
func readBack(e expr.Any) expr.Any {
	if ct, ok := e.(*expr.Ct); ok && ct.Register == 0 && !ct.SourceRegister {
		c := *ct
		c.Register, c.SourceRegister = 1, true
		return &c
	}
	return e
}

// rulesPresent tells whether anything of the redirection is in the
// namespace (a prune's question).
func rulesPresent(h netns.NsHandle) (bool, error) {
	conn, err := nftables.New(nftables.WithNetNSFd(int(h)))
	if err != nil {
		return false, err
	}
	if exists, err := tableExists(conn, NFTTableName); err != nil || exists {
		return exists, err
	}
	nl, err := netlink.NewHandleAt(h)
	if err != nil {
		return false, err
	}
	defer nl.Close()
	for _, family := range []int{unix.AF_INET, unix.AF_INET6} {
		rules, err := nl.RuleList(family)
		if err != nil {
			continue // IPv6 disabled
		}
		if slices.ContainsFunc(rules, func(r netlink.Rule) bool { return r.Table == RouteTable && r.Mark == ConnMark }) {
			return true, nil
		}
	}
	return false, nil
}
