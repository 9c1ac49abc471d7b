// SPDX-License-Identifier: Apache-2.0

package readiness

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/mtlsbridge/mtlsbridge/reconcilers"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/steering"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

type derivationParams struct {
	cell.In

	Node    tables.LocalNode
	Log     *slog.Logger
	DB      *statedb.DB
	Jobs    job.Group
	Pods    statedb.Table[*tables.Pod]
	CNIPods statedb.Table[*tables.CNIPod]
	// Modes: the active one says whether a pod is steered.
	Modes steering.Modes
	Table statedb.RWTable[*ReadyAnnotation]
}

func registerDerivation(p derivationParams) error {
	mode, err := p.Modes.Active()
	if err != nil {
		return fmt.Errorf("readiness: %w", err)
	}
	p.Jobs.Add(job.OneShot("derive-ready-annotations", (&derivation{p, mode}).run))
	return nil
}

// derivation keeps the ready-annotations table equal to what the active
// redirection mode says of this node's pods.
type derivation struct {
	derivationParams
	mode steering.Mode
}

func (d *derivation) run(ctx context.Context, health cell.Health) error {
	// Readiness is judged on the rows of this agent only once they exist:
	// before, every pod would look not ready.
	if !reconcilers.WaitInitialized(ctx, health, d.DB, append([]statedb.TableMeta{d.Pods, d.CNIPods}, d.mode.Tables()...)...) {
		return nil
	}
	return reconcilers.RunDerivation(ctx, health, d.step, func() string {
		return fmt.Sprintf("%d pods to publish", d.Table.NumObjects(d.DB.ReadTxn()))
	})
}

// step derives the node's rows from one snapshot and returns what to
// watch for the next.
func (d *derivation) step() []<-chan struct{} {
	wtxn := d.DB.WriteTxn(d.Table)
	defer wtxn.Commit()
	pods, podsWatch := d.Pods.ListWatch(wtxn, tables.PodsOfThisNode())
	_, cniPodsWatch := d.CNIPods.AllWatch(wtxn)
	var rows []*ReadyAnnotation
	for pod := range pods {
		addrs := tables.PodAddrs(wtxn, d.CNIPods, pod)
		switch state, _ := d.mode.Steering(wtxn, pod.Key(), steering.Sandbox{IPs: addrs}); {
		case state == steering.Steered:
			rows = append(rows, &ReadyAnnotation{Pod: pod.Key(), Ready: true, Shown: pod.RedirectReady})
		case state == steering.NotSteered && pod.RedirectReady:
			rows = append(rows, &ReadyAnnotation{Pod: pod.Key(), Ready: false, Shown: true})
		case state == steering.Settling && pod.RedirectReady:
			// Keep what is published while statuses settle (an agent
			// restart makes every row pending once).
			if old, _, ok := d.Table.Get(wtxn, ByPod(pod.Key())); ok {
				kept := old.clone()
				kept.Shown = true
				rows = append(rows, kept)
			}
		}
	}
	tables.Sync(wtxn, d.Table, rows, tables.SyncOptions[*ReadyAnnotation]{
		// A pod that shows otherwise than published (or published by
		// now) is looked at again: the publisher writes only what differs.
		Same:    func(old, new *ReadyAnnotation) bool { return old.Ready == new.Ready && old.Shown == new.Shown },
		Prepare: func(a *ReadyAnnotation) { a.Status = reconciler.StatusPending() },
	})
	return append([]<-chan struct{}{podsWatch, cniPodsWatch}, d.mode.Watch(wtxn)...)
}
