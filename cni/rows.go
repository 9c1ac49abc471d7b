// SPDX-License-Identifier: Apache-2.0

package cni

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"

	"github.com/mtlsbridge/mtlsbridge/reconcilers"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

type storeParams struct {
	cell.In

	Log       *slog.Logger
	DB        *statedb.DB
	Lifecycle cell.Lifecycle
	Jobs      job.Registry
	Health    cell.Health
	Store     *store
	Pods      statedb.Table[*tables.Pod]
	CNIPods   statedb.RWTable[*tables.CNIPod]
}

// registerStore loads the rows a previous agent kept before the table
// counts as initialized, and removes the rows (and files) of pods deleted
// from the API, whether or not a DEL came: on a node crash none does.
func registerStore(p storeParams) error {
	wtxn := p.DB.WriteTxn(p.Pods, p.CNIPods)
	initDone := p.CNIPods.RegisterInitializer(wtxn, "cni-store")
	// A pod deleted from the API dirties the containers of its rows (a
	// namesake created since keeps its own).
	deletedPods, err := reconcilers.Follow(wtxn, p.Pods, func(txn statedb.ReadTxn, c statedb.Change[*tables.Pod], dirty map[string]struct{}) {
		if !c.Deleted {
			return
		}
		for row := range p.CNIPods.List(txn, tables.CNIPodsByPod(c.Object.Key())) {
			if row.UID == "" || row.UID == c.Object.UID {
				dirty[row.ContainerID] = struct{}{}
			}
		}
	})
	wtxn.Commit()
	if err != nil {
		return err
	}

	p.Lifecycle.Append(cell.Hook{OnStart: func(cell.HookContext) error {
		rows, errs := p.Store.load()
		if len(errs) > 0 {
			p.Log.Error("Some CNI reports in the state folder cannot be read; their pods' addresses come from the API only",
				"folder", p.Store.dir, "error", errors.Join(errs...))
		}
		wtxn := p.DB.WriteTxn(p.CNIPods)
		for _, row := range rows {
			p.CNIPods.Insert(wtxn, row)
		}
		initDone(wtxn)
		wtxn.Commit()
		p.Log.Info("CNI reports loaded", "containers", len(rows))
		return nil
	}})

	jobs := p.Jobs.NewGroup(p.Health)
	// Reports of pods the API never showed (a caller of the socket
	// inventing pods, a pod deleted before the agent saw it): dropped
	// after a grace long enough for the API's watch to catch up.
	jobs.Add(job.Timer("sweep-unknown-cni-pods", func(ctx context.Context) error {
		if ok, _ := p.Pods.Initialized(p.DB.ReadTxn()); !ok {
			return nil
		}
		wtxn := p.DB.WriteTxn(p.CNIPods)
		defer wtxn.Commit()
		p.delete(wtxn, unknownPodRows(wtxn, p.Pods, p.CNIPods, time.Now().Add(-unknownPodGrace)))
		return nil
	}, unknownPodGrace/2))
	jobs.Add(job.OneShot("prune-cni-pods", func(ctx context.Context, health cell.Health) error {
		if !reconcilers.WaitInitialized(ctx, health, p.DB, p.Pods, p.CNIPods) {
			return nil
		}
		// Pods deleted while no agent ran: gone from the first listing.
		wtxn := p.DB.WriteTxn(p.CNIPods)
		var stale []*tables.CNIPod
		for row := range p.CNIPods.All(wtxn) {
			pod, _, ok := p.Pods.Get(wtxn, tables.PodByKey(row.Pod))
			if !ok || !pod.MatchesUID(row.UID) {
				stale = append(stale, row)
			}
		}
		p.delete(wtxn, stale)
		wtxn.Commit()

		return reconcilers.RunDerivation(ctx, health, func() []<-chan struct{} {
			dirty, watches := reconcilers.Collect(p.DB.ReadTxn(), deletedPods)
			if len(dirty) > 0 {
				wtxn := p.DB.WriteTxn(p.CNIPods)
				var gone []*tables.CNIPod
				for id := range dirty {
					if row, _, ok := p.CNIPods.Get(wtxn, tables.CNIPodByContainer(id)); ok {
						gone = append(gone, row)
					}
				}
				p.delete(wtxn, gone)
				wtxn.Commit()
			}
			return watches
		}, func() string { return fmt.Sprintf("%d containers", p.CNIPods.NumObjects(p.DB.ReadTxn())) })
	}))
	return nil
}

// unknownPodGrace is how long a report of a pod the API does not show (or
// shows with another UID) is kept.
const unknownPodGrace = 2 * time.Minute

// unknownPodRows are the rows, last reported before cutoff, whose pod the
// API does not show, or shows with another UID.
func unknownPodRows(txn statedb.ReadTxn, pods statedb.Table[*tables.Pod], cniPods statedb.Table[*tables.CNIPod], cutoff time.Time) []*tables.CNIPod {
	var stale []*tables.CNIPod
	for row := range cniPods.All(txn) {
		if !row.Updated.Before(cutoff) {
			continue
		}
		pod, _, ok := pods.Get(txn, tables.PodByKey(row.Pod))
		if !ok || !pod.MatchesUID(row.UID) {
			stale = append(stale, row)
		}
	}
	return stale
}

func (p storeParams) delete(wtxn statedb.WriteTxn, rows []*tables.CNIPod) {
	for _, row := range rows {
		p.CNIPods.Delete(wtxn, row)
		if err := p.Store.remove(row.ContainerID); err != nil {
			p.Log.Warn("Cannot remove a CNI report from the state folder", "container", row.ContainerID, "error", err)
		}
	}
}
