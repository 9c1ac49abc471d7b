// SPDX-License-Identifier: Apache-2.0

// Package reconcilers holds what the derivations of its subfolders share.
package reconcilers

import (
	"context"
	"fmt"

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
// one it waits for to health, if not nil (a stream has no health of its
// own). It returns false when ctx ends first.
func WaitInitialized(ctx context.Context, health cell.Health, db *statedb.DB, tables ...statedb.TableMeta) bool {
	for _, t := range tables {
		for {
			ok, watch := t.Initialized(db.ReadTxn())
			if ok {
				break
			}
			if health != nil {
				health.OK("waiting for table " + t.Name())
			}
			select {
			case <-ctx.Done():
				return false
			case <-watch:
			}
		}
	}
	return true
}

// Input follows the changes of one table of a derivation and turns each
// change into the keys it makes dirty: the incremental derivations
// (enrollments, workloads, cni-pods' sweeping) recompute only those.
type Input[K comparable] struct {
	next func(txn statedb.ReadTxn, dirty map[K]struct{}) <-chan struct{}
	meta statedb.TableMeta
}

// Follow starts following tbl from now (its current rows come first, as
// changes). touches adds the keys a change makes dirty.
func Follow[T any, K comparable](txn statedb.WriteTxn, tbl statedb.Table[T],
	touches func(txn statedb.ReadTxn, c statedb.Change[T], dirty map[K]struct{})) (Input[K], error) {
	it, err := tbl.Changes(txn)
	if err != nil {
		return Input[K]{}, fmt.Errorf("follow %s: %w", tbl.Name(), err)
	}
	return Input[K]{meta: tbl, next: func(txn statedb.ReadTxn, dirty map[K]struct{}) <-chan struct{} {
		changes, watch := it.Next(txn)
		for c := range changes {
			touches(txn, c, dirty)
		}
		return watch
	}}, nil
}

// Collect drains the unread changes of every input, as txn sees them, into
// one set of dirty keys, and returns the channels that close when there is
// more.
func Collect[K comparable](txn statedb.ReadTxn, inputs ...Input[K]) (map[K]struct{}, []<-chan struct{}) {
	dirty := map[K]struct{}{}
	watches := make([]<-chan struct{}, 0, len(inputs))
	for _, in := range inputs {
		watches = append(watches, in.next(txn, dirty))
	}
	return dirty, watches
}

// Incremental keeps an output table derived from its inputs: each step
// recomputes only the keys the inputs' changes made dirty, and the output
// counts as initialized once every input is and its rows are derived.
type Incremental[K comparable] struct {
	db       *statedb.DB
	output   statedb.TableMeta
	initDone func(statedb.WriteTxn)
	inputs   []Input[K]
	update   func(dirty map[K]struct{})
}

// NewIncremental returns the derivation of output from inputs. initDone is
// output's initializer, registered in the transaction that started
// following the inputs; update recomputes a set of dirty keys.
func NewIncremental[K comparable](db *statedb.DB, output statedb.TableMeta, initDone func(statedb.WriteTxn),
	update func(dirty map[K]struct{}), inputs ...Input[K]) *Incremental[K] {
	return &Incremental[K]{db: db, output: output, initDone: initDone, inputs: inputs, update: update}
}

// Run derives until ctx ends; status describes the output for the job's
// health.
func (d *Incremental[K]) Run(ctx context.Context, health cell.Health, status func() string) error {
	return RunDerivation(ctx, health, d.Step, status)
}

// Initialized reports whether the output has been marked initialized.
func (d *Incremental[K]) Initialized() bool { return d.initDone == nil }

// Step processes every change committed so far and returns the channels
// that close when there is more to do.
func (d *Incremental[K]) Step() []<-chan struct{} {
	txn := d.db.ReadTxn()
	dirty, watches := Collect(txn, d.inputs...)
	if len(dirty) > 0 {
		d.update(dirty)
	}
	if d.initDone == nil {
		return watches
	}
	if waiting := Uninitialized(txn, d.inputs...); len(waiting) > 0 {
		return append(watches, waiting...)
	}
	wtxn := d.db.WriteTxn(d.output)
	d.initDone(wtxn)
	wtxn.Commit()
	d.initDone = nil
	return watches
}

// Uninitialized returns the watch channels of the inputs' tables that are
// not initialized yet (none once all are).
func Uninitialized[K comparable](txn statedb.ReadTxn, inputs ...Input[K]) []<-chan struct{} {
	var watches []<-chan struct{}
	for _, in := range inputs {
		if ok, w := in.meta.Initialized(txn); !ok {
			watches = append(watches, w)
		}
	}
	return watches
}
