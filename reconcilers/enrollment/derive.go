// SPDX-License-Identifier: Apache-2.0

package enrollment

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"

	"github.com/mtlsbridge/mtlsbridge/reconcilers"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

type derivationParams struct {
	cell.In

	Config      Config
	Node        tables.LocalNode
	Log         *slog.Logger
	DB          *statedb.DB
	Jobs        job.Registry
	Health      cell.Health
	Pods        statedb.Table[*tables.Pod]
	Namespaces  statedb.Table[*tables.Namespace]
	Policies    statedb.Table[*tables.Policy]
	CNIPods     statedb.Table[*tables.CNIPod]
	Enrollments statedb.RWTable[*Enrollment]
}

// derivation keeps the enrollments table equal to decide() applied to every
// pod. It follows the change iterators of its inputs and recomputes only the
// pods a change can affect.
type derivation struct {
	derivationParams
	*reconcilers.Incremental[string]
	// anchors caches the policies by anchor (see anchorIndex).
	anchors *anchorIndex
	// updated is set once update has run. Until then every pod of the
	// snapshot is dirty through its own first change, so that the changes
	// of the other inputs need not look for the pods they affect.
	updated bool
}

func newDerivation(p derivationParams) (*derivation, error) {
	d := &derivation{derivationParams: p}
	wtxn := p.DB.WriteTxn(p.Pods, p.Namespaces, p.Policies, p.CNIPods, p.Enrollments)
	defer wtxn.Abort()
	pods, err := reconcilers.Follow(wtxn, p.Pods, podTouches)
	if err != nil {
		return nil, err
	}
	namespaces, err := reconcilers.Follow(wtxn, p.Namespaces, d.namespaceTouches)
	if err != nil {
		return nil, err
	}
	policies, err := reconcilers.Follow(wtxn, p.Policies, d.policyTouches)
	if err != nil {
		return nil, err
	}
	cniPods, err := reconcilers.Follow(wtxn, p.CNIPods, d.cniPodTouches)
	if err != nil {
		return nil, err
	}
	d.Incremental = reconcilers.NewIncremental(p.DB, p.Enrollments, p.Enrollments.RegisterInitializer(wtxn, "enrollment"),
		d.update, pods, namespaces, policies, cniPods)
	wtxn.Commit()
	return d, nil
}

// A pod change affects that pod.
func podTouches(_ statedb.ReadTxn, c statedb.Change[*tables.Pod], dirty map[string]struct{}) {
	dirty[c.Object.Key()] = struct{}{}
}

// A CNI report affects its pod: it may bring the pod's first addresses.
func (d *derivation) cniPodTouches(_ statedb.ReadTxn, c statedb.Change[*tables.CNIPod], dirty map[string]struct{}) {
	if d.updated {
		dirty[c.Object.Pod] = struct{}{}
	}
}

// A namespace change affects every pod in it (namespace label, namespace
// labels in selectors).
func (d *derivation) namespaceTouches(txn statedb.ReadTxn, c statedb.Change[*tables.Namespace], dirty map[string]struct{}) {
	if !d.updated {
		return
	}
	for pod := range tables.PodsOfNamespace(txn, d.Pods, c.Object.Name) {
		dirty[pod.Key()] = struct{}{}
	}
}

// A policy change affects the pods it enrolled before (found through the
// enrollments it is named in) and the pods it selects now. A pod it selected
// before but did not enroll was enrolled by a rule that still holds.
func (d *derivation) policyTouches(txn statedb.ReadTxn, c statedb.Change[*tables.Policy], dirty map[string]struct{}) {
	p := c.Object
	for e := range d.Enrollments.List(txn, ByPolicy(p.Key())) {
		dirty[e.Key()] = struct{}{}
	}
	if c.Deleted || !p.RequiresAuthentication() || !d.updated {
		return
	}
	visit := func(pod *tables.Pod) {
		if _, seen := dirty[pod.Key()]; !seen && p.Selects(pod, namespaceOf(d, txn, pod), d.Config.ClusterName) {
			dirty[pod.Key()] = struct{}{}
		}
	}
	if p.Kind == tables.KindCNP {
		for pod := range tables.PodsOfNamespace(txn, d.Pods, p.Namespace) {
			visit(pod)
		}
		return
	}
	// A CCNP scoped to namespaces visits their pods; one that is not visits
	// every pod (a pod label index would cost more memory per pod than
	// these rare cluster-wide changes cost in time).
	for _, sel := range p.Selectors {
		if ns, ok := sel.Namespace(); ok {
			for pod := range tables.PodsOfNamespace(txn, d.Pods, ns) {
				visit(pod)
			}
			continue
		}
		for pod := range d.Pods.All(txn) {
			visit(pod)
		}
	}
}

func namespaceOf(d *derivation, txn statedb.ReadTxn, pod *tables.Pod) *tables.Namespace {
	ns, _, _ := d.Namespaces.Get(txn, tables.NamespaceByName(pod.Namespace))
	return ns
}

func (d *derivation) run(ctx context.Context, health cell.Health) error {
	return d.Run(ctx, health, func() string {
		return fmt.Sprintf("%d pods", d.Enrollments.NumObjects(d.DB.ReadTxn()))
	})
}

// update recomputes the dirty pods in one transaction. Rows that come out
// equal are not rewritten, so that readers of the enrollments' changes see
// only real changes. A row is kept for each pod of this node and each
// enrolled pod of the cluster: a remote pod that is not enrolled concerns
// only its own node's agent, and its row would cost every node memory.
// The signer keeps as well each pod awaiting its address.
func (d *derivation) update(dirty map[string]struct{}) {
	start := time.Now()
	wtxn := d.DB.WriteTxn(d.Enrollments)
	if d.anchors == nil || d.anchors.revision != d.Policies.Revision(wtxn) {
		d.anchors = newAnchorIndex(wtxn, d.Policies)
	}
	in := &inputs{txn: wtxn, namespaces: d.Namespaces, policies: d.Policies, anchors: d.anchors}
	changed := 0
	var logged []*Enrollment
	// A node agent keeps its own pods' rows; the signer (no node of its
	// own) signs for pods awaiting their address too.
	keepsUnenrolled := func(e *Enrollment) bool { return e.Node == d.Node.NodeName }
	if d.Node.NodeName == "" {
		keepsUnenrolled = func(e *Enrollment) bool { return e.AwaitingIP }
	}
	// In key order: neighbouring pods share the tree nodes that the lookups
	// and inserts walk, which stay in cache (a cold pass: 100,000 pods).
	for _, key := range slices.Sorted(maps.Keys(dirty)) {
		old, _, hadOld := d.Enrollments.Get(wtxn, ByKey(key))
		pod, _, found := d.Pods.Get(wtxn, tables.PodByKey(key))
		var e *Enrollment
		if found {
			// The addresses the sandbox got count before the API has them
			// (cni-pods holds only this node's sandboxes).
			if pod.NodeName == d.Node.NodeName || pod.NodeName == "" {
				pod = tables.WithPodAddrs(wtxn, d.CNIPods, pod)
			}
			e = decide(d.Config, in, pod)
		}
		switch keep := e != nil && (e.Enrolled || keepsUnenrolled(e)); {
		case keep && (!hadOld || *e != *old):
			d.Enrollments.Insert(wtxn, e)
			changed++
			// Another node's pod awaiting its address is not news: its
			// enrollment, moments later, is.
			awaitingElsewhere := e.AwaitingIP && e.Node != d.Node.NodeName
			if !awaitingElsewhere && (!hadOld || e.Enrolled != old.Enrolled || e.Reason != old.Reason || e.Note() != old.Note()) {
				logged = append(logged, e)
			}
		case !keep && hadOld:
			d.Enrollments.Delete(wtxn, old)
			changed++
			if e != nil && old.Enrolled {
				logged = append(logged, e)
			}
		}
	}
	wtxn.Commit()
	d.updated = true
	// One line per decision that changed, once committed; a cold start
	// (every pod new) says it in one line.
	if !d.Initialized() && len(logged) > 1 {
		d.Log.Info("Enrollments derived", "pods", len(logged))
	} else {
		for _, e := range logged {
			args := []any{"pod", e.Key(), "enrolled", e.Enrolled, "reason", e.Reason}
			if note := e.Note(); note != "" {
				args = append(args, "note", note)
			}
			d.Log.Info("Enrollment changed", args...)
		}
	}
	d.Log.Debug("Enrollments updated", "considered", len(dirty), "changed", changed, "duration", time.Since(start))
}
