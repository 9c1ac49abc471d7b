// SPDX-License-Identifier: Apache-2.0

// Package reconcilers holds what the derivations of its subfolders share.
package reconcilers

import (
	"context"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
)

// RunDerivation runs a derivation until ctx ends: step processes every
// change committed so far and returns the channels that close when there is
// more to do; status describes the result for the health of the job.
func RunDerivation(ctx context.Context, health cell.Health, step func() []<-chan struct{}, status func() string) error {
	ws := statedb.NewWatchSet()
	for {
		ws.Clear()
		ws.Add(step()...)
		health.OK(status())
		if _, err := ws.Wait(ctx, 0); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
	}
}

// WaitInitialized waits until every table is initialized, reporting which
// one it waits for. It returns false when ctx ends first.
func WaitInitialized(ctx context.Context, health cell.Health, db *statedb.DB, tables ...statedb.TableMeta) bool {
	for _, t := range tables {
		for {
			ok, watch := t.Initialized(db.ReadTxn())
			if ok {
				break
			}
			health.OK("waiting for table " + t.Name())
			select {
			case <-ctx.Done():
				return false
			case <-watch:
			}
		}
	}
	return true
}
