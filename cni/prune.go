// SPDX-License-Identifier: Apache-2.0

package cni

import (
	"context"
	"fmt"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"

	"github.com/mtlsbridge/mtlsbridge/reconcilers"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

type pruneParams struct {
	cell.In

	DB      *statedb.DB
	Jobs    job.Registry
	Health  cell.Health
	Pods    statedb.Table[*tables.Pod]
	CNIPods statedb.RWTable[*Pod]
}

// registerPrune removes the cni-pods rows of pods deleted from the API, so
// that a DEL the runtime never sent (node crash) leaves no row behind.
func registerPrune(p pruneParams) error {
	wtxn := p.DB.WriteTxn(p.Pods, p.CNIPods)
	changes, err := p.Pods.Changes(wtxn)
	wtxn.Commit()
	if err != nil {
		return fmt.Errorf("follow %s: %w", p.Pods.Name(), err)
	}
	p.Jobs.NewGroup(p.Health).Add(job.OneShot("prune-cni-pods", func(ctx context.Context, health cell.Health) error {
		return reconcilers.RunDerivation(ctx, health, func() []<-chan struct{} {
			wtxn := p.DB.WriteTxn(p.CNIPods)
			seq, watch := changes.Next(wtxn)
			for c := range seq {
				if !c.Deleted {
					continue
				}
				var gone []*Pod
				for row := range p.CNIPods.List(wtxn, PodsByPod(c.Object.Key())) {
					gone = append(gone, row)
				}
				for _, row := range gone {
					p.CNIPods.Delete(wtxn, row)
				}
			}
			wtxn.Commit()
			return []<-chan struct{}{watch}
		}, func() string { return fmt.Sprintf("%d containers", p.CNIPods.NumObjects(p.DB.ReadTxn())) })
	}))
	return nil
}
