// SPDX-License-Identifier: Apache-2.0

package inpod

// The node's side of the in-pod mode: the kubelet's probes. The in-pod
// rules let TCP from the probe addresses past ztunnel, so that a pod's
// probes do not depend on ztunnel; the node makes its own connections to
// those pods come from there (istio-cni's host rule, in nftables):
//
//	table inet mtlsbridge-probes
//	  set pods-v4 { type ipv4_addr }, set pods-v6 { type ipv6_addr }: the in-pod pods' addresses
//	  chain postrouting-nat (nat, postrouting, srcnat - 1):
//	    tcp to @pods-v4, from a local address, by a socket of the node -> snat to 169.254.7.127
//	    tcp to @pods-v6, from a local address, by a socket of the node -> snat to fd16:9254:7127:1337:ffff:ffff:ffff:ffff
//
// "From a local address" leaves out what the node forwards from pods and
// transparent sockets speaking for others (an L7 proxy connecting in a
// client pod's name); "by a socket of the node" (a user-space socket of
// this namespace, as iptables' --socket-exists in istio-cni) also leaves
// out forwarded packets that carry a node's address. One priority before
// iptables' nat POSTROUTING: the first SNAT of a connection is the one
// that holds, and istio-cni inserts its rule first too.

import (
	"cmp"
	"context"
	"fmt"
	"iter"
	"log/slog"
	"net/netip"
	"slices"
	"sync/atomic"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"

	"github.com/mtlsbridge/mtlsbridge/api"
	"github.com/mtlsbridge/mtlsbridge/reconcilers"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/steering"
)

// ProbeTableName is the node's nftables table (family inet) of the probes'
// SNAT.
const ProbeTableName = "mtlsbridge-probes"

const (
	probeSetV4  = "pods-v4"
	probeSetV6  = "pods-v6"
	probesChain = "postrouting-nat"
)

// probeSets are the table's sets holding ips, by family.
func probeSets(table *nftables.Table, ips []netip.Addr) []setSpec {
	v4 := setSpec{set: &nftables.Set{Table: table, Name: probeSetV4, KeyType: nftables.TypeIPAddr}}
	v6 := setSpec{set: &nftables.Set{Table: table, Name: probeSetV6, KeyType: nftables.TypeIP6Addr}}
	for _, ip := range ips {
		if ip = ip.Unmap(); ip.Is4() {
			v4.elements = append(v4.elements, nftables.SetElement{Key: ip.AsSlice()})
		} else {
			v6.elements = append(v6.elements, nftables.SetElement{Key: ip.AsSlice()})
		}
	}
	return []setSpec{v4, v6}
}

// probeRuleset is the table's chain, looking up the sets v4 and v6.
func probeRuleset(v4, v6 *nftables.Set) []chainSpec {
	// Before iptables' nat POSTROUTING (srcnat).
	priority := nftables.ChainPriorityRef(*nftables.ChainPriorityNATSource - 1)
	rule := func(family byte, daddrOffset, n uint32, set *nftables.Set, to netip.Addr) []expr.Any {
		return slices.Concat(nfproto(family), tcp(), []expr.Any{
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: daddrOffset, Len: n},
			&expr.Lookup{SourceRegister: 1, SetName: set.Name, SetID: set.ID},
			// From an address of the node.
			&expr.Fib{Register: 1, FlagSADDR: true, ResultADDRTYPE: true},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: native32(unix.RTN_LOCAL)},
			// By a socket of the node: the load fails for anything else.
			&expr.Meta{Key: expr.MetaKeySKUID, Register: 1},
			&expr.Cmp{Op: expr.CmpOpGte, Register: 1, Data: native32(0)},
			&expr.Immediate{Register: 1, Data: to.AsSlice()},
			// As the kernel reads it back: a range of one address.
			&expr.NAT{Type: expr.NATTypeSourceNAT, Family: uint32(family), RegAddrMin: 1, RegAddrMax: 1},
		})
	}
	return []chainSpec{{probesChain, nftables.ChainTypeNAT, nftables.ChainHookPostrouting, priority, [][]expr.Any{
		rule(unix.NFPROTO_IPV4, 16, 4, v4, ProbeSNAT4),
		rule(unix.NFPROTO_IPV6, 24, 16, v6, ProbeSNAT6),
	}}}
}

// writeProbeSNAT makes the node's table SNAT its connections to ips, in
// one transaction; without ips, the table goes.
func writeProbeSNAT(conn *nftables.Conn, ips []netip.Addr) error {
	table := &nftables.Table{Name: ProbeTableName, Family: nftables.TableFamilyINet}
	if len(ips) == 0 {
		return deleteTable(conn, table)
	}
	sets := probeSets(table, ips)
	return replaceTable(conn, table, sets, func() []chainSpec { return probeRuleset(sets[0].set, sets[1].set) })
}

// Gaps of the node's probe table (prefixes of what checkProbeSNAT says).
const (
	gapProbesMissing  = "probe SNAT table missing"
	GapProbesAltered  = "probe SNAT table altered"
	gapProbesLeftover = "probe SNAT table present, no pod to SNAT for"
)

// checkProbeSNAT tells how the node's table differs from what
// writeProbeSNAT(ips) writes; nothing when it is in place.
func checkProbeSNAT(conn *nftables.Conn, ips []netip.Addr) ([]string, error) {
	exists, err := tableExists(conn, ProbeTableName)
	switch {
	case err != nil:
		return nil, err
	case len(ips) == 0 && exists:
		return []string{gapProbesLeftover}, nil
	case len(ips) == 0:
		return nil, nil
	case !exists:
		return []string{gapProbesMissing}, nil
	}
	table := &nftables.Table{Name: ProbeTableName, Family: nftables.TableFamilyINet}
	want := probeSets(table, ips)
	// Read back, a lookup names its set without the ID of the transaction
	// that made it.
	diffs := diffTable(conn, table, probeRuleset(want[0].set, want[1].set))
	for _, s := range want {
		have, err := conn.GetSetByName(table, s.set.Name)
		if err != nil {
			diffs = append(diffs, fmt.Sprintf("set %s: %v", s.set.Name, err))
			continue
		}
		elements, err := conn.GetSetElements(have)
		if err != nil {
			diffs = append(diffs, fmt.Sprintf("set %s: %v", s.set.Name, err))
			continue
		}
		if have, want := elementAddrs(elements), elementAddrs(s.elements); !slices.Equal(have, want) {
			diffs = append(diffs, fmt.Sprintf("set %s holds %v, want %v", s.set.Name, have, want))
		}
	}
	gaps := make([]string, len(diffs))
	for i, d := range diffs {
		gaps[i] = GapProbesAltered + ": " + d
	}
	return gaps, nil
}

// elementAddrs are the addresses a set's elements hold, sorted (a key of
// another length shows as an invalid address).
func elementAddrs(es []nftables.SetElement) []netip.Addr {
	out := make([]netip.Addr, len(es))
	for i, e := range es {
		out[i], _ = netip.AddrFromSlice(e.Key)
	}
	slices.SortFunc(out, netip.Addr.Compare)
	return out
}

type probeSNATParams struct {
	cell.In

	Mode         steering.Config `optional:"true"`
	Config       Config
	Log          *slog.Logger
	DB           *statedb.DB
	Jobs         job.Group
	Redirections statedb.Table[*Redirection]
	Target       Target
	// CheckInterval replaces defaultProbeCheckInterval (tests).
	CheckInterval probeCheckInterval `optional:"true"`
}

// probeCheckInterval is how often the node's table is read again: someone
// may flush it (Istio #60607).
type probeCheckInterval time.Duration

const defaultProbeCheckInterval = probeCheckInterval(30 * time.Second)

// probeSNAT keeps the node's table holding the addresses of every pod
// whose redirection is written or being written, in the in-pod mode with
// --probe-snat; in the l2 mode with --probe-snat, a table an earlier agent
// left goes at start. Without --probe-snat it touches nothing on the node
// (tests' agents run in the host's namespace).
type probeSNAT struct {
	p probeSNATParams
	// routing is why Cilium's routing refuses the SNAT, or nil: under BPF
	// host routing a pod's reply to the probe address leaves by the
	// uplink, past the node's connection tracking, and every probe would
	// fail. Read once: Cilium's agent restarts to change it.
	routing error
	// problem is why the node's connections are not SNATed now, for
	// /healthz; nil when they are.
	problem atomic.Pointer[error]
	// checkNow asks for a check before the next interval (inpod/prune).
	checkNow chan struct{}
}

func newProbeSNAT(p probeSNATParams) *probeSNAT {
	s := &probeSNAT{p: p, checkNow: make(chan struct{}, 1)}
	switch {
	case !p.Config.ProbeSNAT:
	case p.Mode.Mode() == steering.ModeInPod:
		if dir := p.Mode.CiliumConfigDir; dir != "" {
			s.routing = steering.HostLegacyRouting(dir)
		}
		if s.routing != nil {
			err := refused(s.routing)
			s.problem.Store(&err)
		}
		p.Jobs.Add(job.OneShot("probe-snat", s.run))
	default:
		p.Jobs.Add(job.OneShot("probe-snat", s.removeLeftover, job.WithRetry(-1, &job.ExponentialBackoff{Min: time.Second, Max: time.Minute})))
	}
	return s
}

// readinessCheck is a /healthz warning while the node's connections to
// in-pod pods are not SNATed as asked.
func (s *probeSNAT) readinessCheck() api.CheckOut {
	return api.CheckOut{Check: api.Check{Name: "probe-snat", Warning: true, Err: func() error {
		if err := s.problem.Load(); err != nil {
			return *err
		}
		return nil
	}}}
}

func (s *probeSNAT) removeLeftover(ctx context.Context, health cell.Health) error {
	if err := s.p.Target.WriteProbeSNAT(nil); err != nil {
		// Logged, shown in health and retried by the job.
		err = fmt.Errorf("a probe SNAT table the in-pod mode left on the node is not removed: %w", err)
		s.problem.Store(&err)
		return err
	}
	s.problem.Store(nil)
	health.OK("inactive (--redirect-mode=" + s.p.Mode.Mode() + "): none on the node")
	return nil
}

func (s *probeSNAT) run(ctx context.Context, health cell.Health) error {
	// An empty table before the derivation ran would remove the SNAT of
	// pods that keep their redirection across a restart.
	if !reconcilers.WaitInitialized(ctx, health, s.p.DB, s.p.Redirections) {
		return nil
	}
	var inPlace []netip.Addr // what the node held at the last check, if known
	known, recheck := false, true
	var logged string
	retry := time.Second
	interval := time.Duration(cmp.Or(s.p.CheckInterval, defaultProbeCheckInterval))
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		rows, watch := s.p.Redirections.AllWatch(s.p.DB.ReadTxn())
		var ips []netip.Addr // none under BPF host routing: the table goes
		if s.routing == nil {
			ips = probeAddrs(rows)
		}
		var again <-chan time.Time
		// Rows change with every status update; the node is read again
		// when their addresses change, and periodically.
		if recheck || !known || !slices.Equal(ips, inPlace) {
			var err error
			if err = s.sync(ips, inPlace, known); err == nil {
				inPlace, known, retry = ips, true, time.Second
			} else {
				known = false
				again = time.After(retry)
				retry = min(2*retry, interval)
			}
			s.report(health, len(ips), err, &logged)
		}
		recheck = false
		select {
		case <-ctx.Done():
			return nil
		case <-watch:
		case <-tick.C:
			recheck = true
		case <-again:
			recheck = true
		case <-s.checkNow:
			recheck = true
		}
	}
}

// check asks for the node to be read again now.
func (s *probeSNAT) check() {
	select {
	case s.checkNow <- struct{}{}:
	default:
	}
}

// report tells health, /healthz and (once per cause) the log how the
// node's SNAT stands after a check.
func (s *probeSNAT) report(health cell.Health, n int, err error, logged *string) {
	switch {
	case err != nil:
		err = fmt.Errorf("the SNAT of the kubelet's probes is not written on the node: %w", err)
		health.Degraded("probe SNAT not written", err)
	case s.routing != nil:
		err = refused(s.routing)
		health.Degraded("probe SNAT refused", err)
	default:
		health.OK(fmt.Sprintf("the node's connections to %d pod addresses SNATed to %s / %s", n, ProbeSNAT4, ProbeSNAT6))
		s.problem.Store(nil)
		*logged = ""
		return
	}
	s.problem.Store(&err)
	// A failure that lasts is retried quietly.
	if err.Error() != *logged {
		s.p.Log.Error("Probe SNAT", "error", err)
		*logged = err.Error()
	}
}

func refused(routing error) error {
	return fmt.Errorf("the kubelet's probes are not SNATed (--probe-snat): %w", routing)
}

// sync reads the node's table and writes it if it differs from ips;
// known: the node held inPlace at the last check.
func (s *probeSNAT) sync(ips, inPlace []netip.Addr, known bool) error {
	gaps, err := s.p.Target.CheckProbeSNAT(ips)
	if err != nil || len(gaps) == 0 {
		return err
	}
	if known && slices.Equal(ips, inPlace) {
		s.p.Log.Warn("SNAT of the kubelet's probes altered on the node, written again", "gaps", gaps)
	}
	return s.p.Target.WriteProbeSNAT(ips)
}

// probeAddrs are the addresses of the pods whose redirection is written or
// being written (not of those whose namespace is unknown), sorted, once
// each.
func probeAddrs(rows iter.Seq2[*Redirection, statedb.Revision]) []netip.Addr {
	var ips []netip.Addr
	for r := range rows {
		if r.Problem == "" {
			ips = append(ips, r.IPs...)
		}
	}
	slices.SortFunc(ips, netip.Addr.Compare)
	return slices.Compact(ips)
}
