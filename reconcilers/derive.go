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

// Sync makes tbl hold exactly the rows of want, keyed by keyOf: rows not
// wanted are deleted; a wanted row is inserted, after prepare (e.g. setting
// its reconcile status to pending), unless the table already has one that
// same accepts, so that readers of the table's changes see real changes
// only.
func Sync[K comparable, T any](txn statedb.WriteTxn, tbl statedb.RWTable[T], want map[K]T,
	keyOf func(T) K, same func(old, new T) bool, prepare func(T)) {
	var gone []T // collected first: the table is not changed while iterated
	for row := range tbl.All(txn) {
		if _, ok := want[keyOf(row)]; !ok {
			gone = append(gone, row)
		}
	}
	for _, row := range gone {
		tbl.Delete(txn, row)
	}
	idx := tbl.PrimaryIndexer()
	for _, row := range want {
		if q, ok := idx.QueryFromObject(row); ok {
			if old, _, found := tbl.Get(txn, q); found && same(old, row) {
				continue
			}
		}
		prepare(row)
		tbl.Insert(txn, row)
	}
}
