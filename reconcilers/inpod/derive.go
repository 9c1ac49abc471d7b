// SPDX-License-Identifier: Apache-2.0

package inpod

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/mtlsbridge/mtlsbridge/reconcilers"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/enrollment"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/steering"
	"github.com/mtlsbridge/mtlsbridge/tables"
	"github.com/mtlsbridge/mtlsbridge/zds/nodeagent"
)

type derivationParams struct {
	cell.In

	Mode         steering.Config `optional:"true"`
	Log          *slog.Logger
	DB           *statedb.DB
	Jobs         job.Group
	Pods         statedb.Table[*tables.Pod]
	CNIPods      statedb.Table[*tables.CNIPod]
	Enrollments  statedb.Table[*enrollment.Enrollment]
	Redirections statedb.RWTable[*Redirection]
	Workloads    statedb.RWTable[*nodeagent.Workload]
}

// derivation keeps the inpod and zds tables equal to what the node's
// enrolled pods need: the redirection in each pod's namespace, and the pod
// handed to ztunnel. Both come from the newest CNI report of the pod's
// sandbox, which names its namespace. In another mode the tables stay
// empty, which makes the reconciler remove the redirections left in the
// pods' namespaces (Cilium #47303: leftover rules blackhole pods), an
// enrolled pod's once that mode steers it.
type derivation struct {
	derivationParams
	initDone []func(statedb.WriteTxn)
}

func registerDerivation(p derivationParams) {
	d := &derivation{derivationParams: p}
	wtxn := p.DB.WriteTxn(p.Redirections, p.Workloads)
	d.initDone = []func(statedb.WriteTxn){
		p.Redirections.RegisterInitializer(wtxn, "inpod-derivation"),
		p.Workloads.RegisterInitializer(wtxn, "inpod-derivation"),
	}
	wtxn.Commit()
	p.Jobs.Add(job.OneShot("derive-inpod", d.run))
}

func (d *derivation) run(ctx context.Context, health cell.Health) error {
	// Nothing is derived from a partial view: a pod listed before the
	// policy that enrolls it would lose its redirection (the reconciler
	// prunes once the table is initialized).
	if !reconcilers.WaitInitialized(ctx, health, d.DB, d.Enrollments, d.Pods, d.CNIPods) {
		return nil
	}
	if d.Mode.Mode() != steering.ModeInPod {
		wtxn := d.DB.WriteTxn(d.Redirections, d.Workloads)
		for _, done := range d.initDone {
			done(wtxn)
		}
		wtxn.Commit()
		health.OK("inactive (--redirect-mode=" + d.Mode.Mode() + "): no redirection in pods")
		return nil
	}
	return reconcilers.RunDerivation(ctx, health, d.step, func() string {
		return fmt.Sprintf("%d pods redirected in their namespace", d.Redirections.NumObjects(d.DB.ReadTxn()))
	})
}

// step derives the node's rows from one snapshot and returns what to
// watch for the next.
func (d *derivation) step() []<-chan struct{} {
	wtxn := d.DB.WriteTxn(d.Redirections, d.Workloads)
	defer wtxn.Commit()
	enrollments, enrollWatch := d.Enrollments.ListWatch(wtxn, enrollment.OfThisNode())
	_, podsWatch := d.Pods.ListWatch(wtxn, tables.PodsOfThisNode())
	_, cniWatch := d.CNIPods.AllWatch(wtxn)

	var redirections []*Redirection
	var workloads []*nodeagent.Workload
	for e := range enrollments {
		if !e.Enrolled || e.MTLSAgent {
			continue
		}
		pod, _, ok := d.Pods.Get(wtxn, tables.PodByKey(e.Key()))
		if !ok || pod.HostNetwork || pod.Finished() {
			continue
		}
		r, w := desired(wtxn, d.CNIPods, pod)
		redirections = append(redirections, r)
		workloads = append(workloads, w)
	}
	tables.Sync(wtxn, d.Redirections, redirections, tables.SyncOptions[*Redirection]{
		Same: (*Redirection).sameDesire,
		Prepare: func(r *Redirection) {
			r.Status = reconciler.StatusPending()
			if r.Problem != "" {
				// Nothing to write: the row says why (the reconciler would
				// only fail with the same words).
				r.Status = reconciler.StatusError(fmt.Errorf("%s", r.Problem))
			}
		},
	})
	tables.Sync(wtxn, d.Workloads, workloads, tables.SyncOptions[*nodeagent.Workload]{
		Same:    (*nodeagent.Workload).SameDesire,
		Prepare: func(w *nodeagent.Workload) { w.State = nodeagent.StatePending },
	})
	for _, done := range d.initDone {
		done(wtxn)
	}
	return []<-chan struct{}{enrollWatch, podsWatch, cniWatch}
}

// desired is the pure part: an enrolled pod's rows.
func desired(txn statedb.ReadTxn, cniPods statedb.Table[*tables.CNIPod], pod *tables.Pod) (*Redirection, *nodeagent.Workload) {
	report := newestReport(txn, cniPods, pod)
	r := &Redirection{Pod: pod.Key(), UID: pod.UID, IPs: tables.PodAddrs(txn, cniPods, pod)}
	w := &nodeagent.Workload{
		Pod: pod.Key(), UID: pod.UID,
		// Exactly the Workload's over xDS (package workload): ztunnel waits
		// for a Workload of this name, namespace and service account.
		Name: pod.Name, Namespace: pod.Namespace, ServiceAccount: pod.ServiceAccountOrDefault(),
	}
	if report != nil {
		r.Netns, w.Netns = report.Netns, report.Netns
		if w.UID == "" {
			r.UID, w.UID = report.UID, report.UID
		}
	}
	switch {
	case report == nil:
		r.Problem = ErrNoNetns.Error()
		w.Problem = r.Problem
	case w.UID == "":
		w.Problem = ErrNoUID.Error()
	}
	return r, w
}

// newestReport is the newest CNI report of the pod's sandbox that names a
// network namespace; reports of an earlier pod of the same name (another
// UID) do not count.
func newestReport(txn statedb.ReadTxn, cniPods statedb.Table[*tables.CNIPod], pod *tables.Pod) *tables.CNIPod {
	var newest *tables.CNIPod
	for row := range cniPods.List(txn, tables.CNIPodsByPod(pod.Key())) {
		if row.Netns == "" || !pod.MatchesUID(row.UID) {
			continue
		}
		if newest == nil || row.Updated.After(newest.Updated) {
			newest = row
		}
	}
	return newest
}
