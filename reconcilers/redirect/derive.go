// SPDX-License-Identifier: Apache-2.0

package redirect

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/mtlsbridge/mtlsbridge/bpf"
	"github.com/mtlsbridge/mtlsbridge/reconcilers"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/enrollment"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/steering"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

type derivationParams struct {
	cell.In

	Config      Config
	Node        tables.LocalNode
	Log         *slog.Logger
	DB          *statedb.DB
	Jobs        job.Group
	Pods        statedb.Table[*tables.Pod]
	CNIPods     statedb.Table[*tables.CNIPod]
	Nodes       statedb.Table[*tables.Node]
	Enrollments statedb.Table[*enrollment.Enrollment]
	Redirects   statedb.RWTable[*Redirect]
	Attachments statedb.RWTable[*Attachment]
	Interfaces  Interfaces
	Datapath    Datapath
	Mode        steering.Config `optional:"true"`
}

// derivation keeps the redirects and attachments tables equal to what the
// node's pods, their enrollments, the node's addresses and its interfaces
// ask for. It recomputes the node's rows as a whole (a node has a few
// hundred pods at most) and rewrites only the rows that changed.
type derivation struct {
	derivationParams
	initDone []func(statedb.WriteTxn)
	// disabled: --enable-redirect=false. The rows still say what would be
	// steered; their status says that nothing is applied.
	disabled bool
	// inherited: the from-pod links a previous agent left, by the
	// addresses they steer (see inheritedAttachments); nil until read.
	// A pod's own row, once it has one, takes precedence.
	inherited map[netip.Addr]*Attachment
}

// Pacing of the derivation: changes that come together (a pod's veth and
// its addresses) are taken in one pass, except a CNI report, which a pod
// start waits for; passes (a scan of the node's interfaces, which grows with its pods)
// take at most 1/passDuty of the time, so that netlink events of pods
// churning on a large node do not keep a core scanning, while on a node
// whose scan takes a millisecond a pod's veth is seen within a few; rows
// with problems are retried with backoff.
const (
	settle        = 2 * time.Millisecond
	passDuty      = 5
	minRetry      = 500 * time.Millisecond
	maxRetry      = 30 * time.Second
	initScanGrace = 10 * time.Second
)

func registerDerivation(p derivationParams) {
	if inactive(p.Mode) {
		return // empty tables, initialized: another mode steers
	}
	d := &derivation{derivationParams: p, disabled: errors.Is(p.Datapath.Err(), ErrDisabled)}
	wtxn := p.DB.WriteTxn(p.Redirects, p.Attachments)
	d.initDone = []func(statedb.WriteTxn){
		p.Redirects.RegisterInitializer(wtxn, "redirect-derivation"),
		p.Attachments.RegisterInitializer(wtxn, "redirect-derivation"),
	}
	wtxn.Commit()
	p.Jobs.Add(job.OneShot("derive-redirects", d.run))
}

func (d *derivation) run(ctx context.Context, health cell.Health) error {
	// Nothing is written before every input is initialized: rows from a
	// partial view (a pod listed before the policy enrolling it) would
	// overwrite live entries of a previous agent.
	if !reconcilers.WaitInitialized(ctx, health, d.DB, d.Enrollments, d.Pods, d.CNIPods, d.Nodes) {
		return nil
	}

	retry := minRetry
	start := time.Now()
	var nextPass time.Time
	for {
		changed := d.Interfaces.Changed()
		var scan Scan
		var scanErr error
		var left map[netip.Addr]*Attachment
		passStart := time.Now() // what a pass costs paces the next
		if !d.disabled {
			if d.inherited == nil {
				// Until it is read: the datapath may load after this starts
				// (another agent holding the BPF root's lock).
				d.inherited = inheritedAttachments(d.Datapath)
			}
			scan, scanErr = d.Interfaces.Scan()
			left = leftBehind(d.inherited, scan, scanErr)
			if scanErr == nil {
				forgetInherited(d.inherited, scan)
			}
		}
		// The tables count as initialized (which lets the reconcilers
		// prune what they do not hold) only after a full scan: a pod
		// missing from a partial one would lose the entries and programs
		// a previous agent left it. A scan that keeps failing delays
		// this for initScanGrace at most.
		complete := scanErr == nil || time.Since(start) > initScanGrace
		watches, problems := d.pass(scan, scanErr, left, complete)
		nextPass = time.Now().Add((passDuty - 1) * time.Since(passStart))
		switch {
		case d.disabled:
			health.OK(fmt.Sprintf("%d redirects desired, none applied: %v", d.Redirects.NumObjects(d.DB.ReadTxn()), ErrDisabled))
		case problems == 0:
			health.OK(fmt.Sprintf("%d redirects", d.Redirects.NumObjects(d.DB.ReadTxn())))
			retry = minRetry
		default:
			health.Degraded("rows with problems",
				errors.Join(fmt.Errorf("%d rows of redirects and attachments with problems", problems), scanErr))
		}
		var retryC, graceC <-chan time.Time
		if problems > 0 || scanErr != nil {
			retryC = time.After(retry)
			retry = min(2*retry, maxRetry)
		}
		if d.initDone != nil {
			// Readiness waits for the initialization, not for the backoff.
			graceC = time.After(time.Until(start.Add(initScanGrace)) + time.Millisecond)
		}
		wait := settle
		select {
		case <-ctx.Done():
			return nil
		case <-watches[0]:
		case <-watches[1]:
		case <-watches[2]:
		case <-watches[3]:
			// A CNI report: its pod's start waits for this pass, and what
			// came together with it (the pod's veth) came before it.
			wait = 0
		case <-changed:
		case <-retryC:
		case <-graceC:
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(max(wait, time.Until(nextPass))):
		}
	}
}

// pass recomputes the rows in one transaction; left are the links a
// previous agent left whose interfaces may still hold their addresses
// (see leftBehind). It returns the watch channels of its inputs and the
// number of rows with a problem.
func (d *derivation) pass(scan Scan, scanErr error, left map[netip.Addr]*Attachment, initialize bool) ([4]<-chan struct{}, int) {
	wtxn := d.DB.WriteTxn(d.Redirects, d.Attachments)
	defer wtxn.Abort()
	node := d.Node.NodeName
	pods, podsWatch := d.Pods.ListWatch(wtxn, tables.PodsOfThisNode())
	_, cniPodsWatch := d.CNIPods.AllWatch(wtxn)
	enrollments, enrollWatch := d.Enrollments.ListWatch(wtxn, enrollment.OfThisNode())
	nodeObj, _, nodeWatch, _ := d.Nodes.GetWatch(wtxn, tables.NodeByName(node))

	enrolled := map[string]*enrollment.Enrollment{}
	for e := range enrollments {
		enrolled[e.Key()] = e
	}
	// A pod's addresses are those its sandbox got, which the API shows
	// only after the CNI ADD that waits for these rows.
	var local []*tables.Pod
	for pod := range pods {
		local = append(local, tables.WithPodAddrs(wtxn, d.CNIPods, pod))
	}
	attached := func(pod *tables.Pod) []*Attachment {
		rows := statedb.Collect(d.Attachments.List(wtxn, AttachmentsByPod(pod.Key())))
		if len(rows) > 0 {
			return rows
		}
		for _, ip := range pod.IPs {
			if a, ok := d.inherited[ip]; ok {
				a = a.clone()
				a.Pod = pod.Key()
				return []*Attachment{a}
			}
		}
		return nil
	}
	// The devices with node-ingress now; where the scan could not list the
	// node's links, also those of this agent's links (a restarted agent
	// has no rows yet) that may be node-ingress ones.
	kept := map[string]int{}
	for a := range d.Attachments.All(wtxn) {
		if a.Hook == bpf.HookNodeIngress && a.Ifindex != 0 {
			kept[a.Device] = a.Ifindex
		}
	}
	if scanErr != nil && len(scan.Devices) == 0 {
		linked, _ := d.Datapath.Attached()
		for dev, idx := range linked {
			if _, ok := kept[dev]; !ok && mayHaveNodeIngress(d.Config, dev) {
				kept[dev] = idx
			}
		}
	}
	want := desired(d.Config, scan, scanErr, local, enrolled, nodeObj, attached, kept)
	previous := statedb.Collect(d.Redirects.All(wtxn))
	for addr, a := range left {
		// The pod is unknown: the map names none.
		previous = append(previous, &Redirect{Addr: addr, Kind: bpf.KindEnrolled, Interface: a.Device,
			Ifindex: uint32(a.Ifindex), MAC: scan.Pods[addr].MAC, NetnsID: bpf.NoNetns})
	}
	keepSandboxesSteered(want, previous, func(device string) (*Attachment, bool) {
		if a, _, ok := d.Attachments.Get(wtxn, AttachmentByDevice(device)); ok {
			return a, true
		}
		for _, a := range left {
			if a.Device == device {
				return a, true
			}
		}
		return nil, false
	}, func(pod string) (*Attachment, bool) {
		for a := range d.Attachments.List(wtxn, AttachmentsByPod(pod)) {
			if a.Hook == bpf.HookFromPod && a.Ifindex != 0 {
				return a, true
			}
		}
		return nil, false
	}, scan, scanErr)
	status := reconciler.StatusPending()
	if d.disabled {
		// Nothing looks for interfaces, and nothing is written: every
		// row says so instead of naming a missing interface.
		status = reconciler.StatusError(ErrDisabled)
		for _, r := range want.redirects {
			r.Problem = ""
		}
		for _, a := range want.attachments {
			a.Problem = ""
		}
	}

	problems := 0
	for _, r := range want.redirects {
		if r.Problem != "" {
			problems++
		}
	}
	for _, a := range want.attachments {
		if a.Problem != "" {
			problems++
		}
	}
	tables.Sync(wtxn, d.Redirects, slices.Collect(maps.Values(want.redirects)), tables.SyncOptions[*Redirect]{
		Same: (*Redirect).sameDesire, Prepare: func(r *Redirect) { r.Status = status }})
	tables.Sync(wtxn, d.Attachments, slices.Collect(maps.Values(want.attachments)), tables.SyncOptions[*Attachment]{
		Same: (*Attachment).sameDesire, Prepare: func(a *Attachment) { a.Status = status }})
	if initialize {
		for _, done := range d.initDone {
			done(wtxn)
		}
		d.initDone = nil
	}
	wtxn.Commit()
	return [4]<-chan struct{}{podsWatch, enrollWatch, nodeWatch, cniPodsWatch}, problems
}

type desiredRows struct {
	redirects   map[netip.Addr]*Redirect
	attachments map[string]*Attachment
}

// desired is the pure part of the derivation: the rows for one node.
//   - A local pod that is enrolled gets an enrolled entry per address,
//     locating its interface, and the from-pod program on that interface.
//   - Every other local pod and the node's addresses get local entries:
//     traffic to them is same-node and never steered.
//   - The node's mTLS agent gets the agent entry.
//   - Each uplink (--devices, or those found) and each of Cilium's tunnel
//     devices that exists gets the node-ingress program (nodeIngress).
//
// A pod whose interface is not found keeps what it has: its entries (the
// reconciler leaves the map as it is for rows with a problem) and its
// attachments, from attached. An interrupted or partial scan must never
// unsteer a running pod.
func desired(cfg Config, scan Scan, scanErr error, pods []*tables.Pod,
	enrolled map[string]*enrollment.Enrollment, node *tables.Node,
	attached func(pod *tables.Pod) []*Attachment, kept map[string]int) desiredRows {
	out := desiredRows{redirects: map[netip.Addr]*Redirect{}, attachments: map[string]*Attachment{}}
	add := func(r *Redirect) {
		if old, ok := out.redirects[r.Addr]; ok && !preferred(r, old) {
			return
		}
		out.redirects[r.Addr] = r
	}
	var agents []*tables.Pod
	for _, pod := range pods {
		if pod.Finished() {
			continue // its address may already belong to a new pod
		}
		e := enrolled[pod.Key()]
		if e != nil && e.MTLSAgent && !pod.HostNetwork {
			agents = append(agents, pod)
		}
		if e == nil || !e.Enrolled || pod.HostNetwork {
			for _, ip := range pod.IPs {
				add(&Redirect{Addr: ip, Kind: bpf.KindLocal, Pod: pod.Key(), NetnsID: bpf.NoNetns})
			}
			continue
		}
		iface, found := findInterface(scan, pod.IPs)
		problem := ""
		if !found {
			problem = noInterface(pod, scan, scanErr)
			for _, a := range attached(pod) {
				out.attachments[a.Device] = a
			}
		} else {
			out.attachments[iface.Name] = &Attachment{Device: iface.Name, Ifindex: iface.Index, Hook: bpf.HookFromPod, Pod: pod.Key()}
		}
		for _, ip := range pod.IPs {
			add(&Redirect{Addr: ip, Kind: bpf.KindEnrolled, Pod: pod.Key(), Interface: iface.Name,
				Ifindex: uint32(iface.Index), MAC: iface.MAC, NetnsID: bpf.NoNetns, Problem: problem})
		}
	}
	// The node's addresses, as Kubernetes knows them and as configured.
	var nodeAddrs []netip.Addr
	if node != nil {
		nodeAddrs = node.Addresses
	}
	for _, ip := range slices.Concat(nodeAddrs, scan.Local) {
		add(&Redirect{Addr: ip, Kind: bpf.KindLocal, NetnsID: bpf.NoNetns})
	}
	out.redirects[bpf.AgentKey] = agentRow(scan, scanErr, agents)
	for _, a := range nodeIngress(cfg, scan, kept) {
		if out.attachments[a.Device] == nil {
			out.attachments[a.Device] = a
		}
	}
	return out
}

// keepSandboxesSteered keeps the enrolled entries of the previous pass
// (or that a previous agent left) that no pod claims any more while the
// interface they located may still hold their address: a pod deleted from
// the API while it runs (a forced deletion, a StatefulSet pod recreated
// at once), a finished pod or an old sandbox the kubelet has not torn
// down yet. Until the interface goes, what runs behind it stays steered
// and never sends in clear. The rows carry a problem, so the reconcilers
// leave their entries and links as they are, and the operator sees why.
// They name no pod: the name may be a new pod's now, whose steering they
// are not; FormerPod says whose they were.
func keepSandboxesSteered(want desiredRows, previous []*Redirect, attachment func(device string) (*Attachment, bool),
	podAttachment func(pod string) (*Attachment, bool), scan Scan, scanErr error) {
	for _, r := range previous {
		if r.Kind != bpf.KindEnrolled {
			continue
		}
		device, ifindex := r.Interface, int(r.Ifindex)
		if ifindex == 0 && r.Pod != "" {
			// Not located in the last pass (its scan failed): the link
			// its pod kept says where it was.
			if a, ok := podAttachment(r.Pod); ok {
				device, ifindex = a.Device, a.Ifindex
			}
		}
		if ifindex == 0 {
			continue // never steered on an interface
		}
		if _, claimed := want.redirects[r.Addr]; claimed || !mayHold(scan, scanErr, r.Addr, device, ifindex) {
			continue
		}
		kept := r.clone()
		kept.Pod, kept.FormerPod, kept.Interface, kept.Ifindex = "", cmp.Or(r.Pod, r.FormerPod), device, uint32(ifindex)
		kept.Problem = fmt.Sprintf("%v: no pod claims %s any more (%s did), but %s still holds it; kept steered until it goes",
			ErrSandboxRunning, r.Addr, cmp.Or(kept.FormerPod, "a pod this agent never saw"), device)
		want.redirects[r.Addr] = kept
		if a, ok := attachment(device); ok && want.attachments[device] == nil {
			a = a.clone()
			a.Pod, a.FormerPod, a.Problem = "", kept.FormerPod, kept.Problem
			want.attachments[device] = a
		}
	}
}

// mayHold tells whether the interface (device, ifindex) may still hold
// addr: a scan finds it there or among the address's claimants; a scan
// that failed cannot tell, unless it listed the node's devices without
// that one.
func mayHold(scan Scan, scanErr error, addr netip.Addr, device string, ifindex int) bool {
	if iface, ok := scan.Pods[addr]; ok {
		return iface.Index == ifindex && iface.Name == device
	}
	if slices.Contains(scan.Claimed[addr], device) {
		return true
	}
	return scanErr != nil && (len(scan.Devices) == 0 || scan.Devices[device] == ifindex)
}

// preferred decides between two rows for one address (two pods claiming
// it): enrolled wins, so that a conflict never unsteers a pod; then the
// lower pod name, so that the choice is stable.
func preferred(r, old *Redirect) bool {
	if (r.Kind == bpf.KindEnrolled) != (old.Kind == bpf.KindEnrolled) {
		return r.Kind == bpf.KindEnrolled
	}
	return r.Pod < old.Pod
}

// agentRow locates the mTLS agent. With several (a rolling update), the
// first by name that has an interface serves.
func agentRow(scan Scan, scanErr error, agents []*tables.Pod) *Redirect {
	r := &Redirect{Addr: bpf.AgentKey, Kind: bpf.KindAgent, NetnsID: bpf.NoNetns}
	slices.SortFunc(agents, func(a, b *tables.Pod) int { return cmp.Compare(a.Key(), b.Key()) })
	for _, pod := range agents {
		if iface, ok := findInterface(scan, pod.IPs); ok {
			r.Pod, r.Interface, r.Ifindex, r.MAC, r.NetnsID = pod.Key(), iface.Name, uint32(iface.Index), iface.MAC, iface.NetnsID
			return r
		}
	}
	if len(agents) == 0 {
		r.Problem = fmt.Sprintf("%v (label %s=%s)", ErrNoAgent, tables.RedirTypeLabel, tables.RedirTypeProxy)
		return r
	}
	r.Pod = agents[0].Key()
	r.Problem = noInterface(agents[0], scan, scanErr)
	return r
}

func findInterface(scan Scan, ips []netip.Addr) (PodInterface, bool) {
	for _, ip := range ips {
		if iface, ok := scan.Pods[ip]; ok {
			return iface, true
		}
	}
	return PodInterface{}, false
}

func noInterface(pod *tables.Pod, scan Scan, scanErr error) string {
	ips := make([]string, len(pod.IPs))
	for i, ip := range pod.IPs {
		if names, ok := scan.Claimed[ip]; ok {
			return fmt.Sprintf("%v: %s is on the peers of %s; kept as it was", ErrAmbiguousInterface, ip, strings.Join(names, " and "))
		}
		ips[i] = ip.String()
	}
	msg := fmt.Sprintf("%v: no veth peer holds %s", ErrNoInterface, strings.Join(ips, ","))
	if scanErr != nil {
		msg += " (scan: " + scanErr.Error() + ")"
	}
	return msg
}

// forgetInherited drops the inherited links that a full scan makes moot:
// of an address now located (its pod's own rows take over), or of an
// interface that is gone or was replaced (its link went with it). A later
// pod with the address is never given a stale link.
func forgetInherited(inherited map[netip.Addr]*Attachment, scan Scan) {
	maps.DeleteFunc(inherited, func(ip netip.Addr, a *Attachment) bool {
		_, located := scan.Pods[ip]
		ifindex, present := scan.Devices[a.Device]
		return located || !present || ifindex != a.Ifindex
	})
}

// leftBehind are the inherited links whose interface may still hold
// their address (see mayHold), by that address. A restarted agent never
// saw the pods that left the API meanwhile, but must not unsteer their
// running sandboxes: keepSandboxesSteered keeps these too, so that they
// are rows before the tables are initialized and pruning starts, however
// long scans fail. A complete scan that locates their address, or shows
// their interface gone or replaced, forgets them (forgetInherited); the
// rows kept take over.
func leftBehind(inherited map[netip.Addr]*Attachment, scan Scan, scanErr error) map[netip.Addr]*Attachment {
	left := map[netip.Addr]*Attachment{}
	for addr, a := range inherited {
		if mayHold(scan, scanErr, addr, a.Device, a.Ifindex) {
			left[addr] = a
		}
	}
	return left
}

// inheritedAttachments reads the from-pod links a previous agent left and
// keys them by the enrolled addresses whose map entries name the link's
// interface. A restarted agent that cannot locate a pod (its scans keep
// failing as pods churn, or another pod claims its addresses) has no row
// of its own for the pod's link; without these, the pruning that follows
// initialization would detach the program and let the pod send in clear.
// It returns nil when the datapath cannot be read (yet).
func inheritedAttachments(dp Datapath) map[netip.Addr]*Attachment {
	entries, err := dp.Entries()
	if err != nil {
		return nil
	}
	links, err := dp.Attached()
	if err != nil {
		return nil
	}
	deviceOf := map[int]string{}
	for device, ifindex := range links {
		if ifindex != 0 {
			deviceOf[ifindex] = device
		}
	}
	out := map[netip.Addr]*Attachment{}
	for addr, e := range entries {
		if device, ok := deviceOf[int(e.Ifindex)]; ok && e.Kind == bpf.KindEnrolled {
			out[addr] = &Attachment{Device: device, Ifindex: int(e.Ifindex), Hook: bpf.HookFromPod,
				Problem: fmt.Sprintf("%v: kept as the previous agent attached it", ErrNoInterface)}
		}
	}
	return out
}
