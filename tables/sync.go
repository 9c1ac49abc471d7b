// SPDX-License-Identifier: Apache-2.0

package tables

import (
	"reflect"

	"github.com/cilium/statedb"
)

// SyncOptions tune Sync. The zero value compares rows with reflect.DeepEqual,
// prepares nothing and owns every row of the table.
type SyncOptions[T any] struct {
	// Same reports whether a row the table holds already says what new
	// says; then new is not written.
	Same func(old, new T) bool
	// Prepare is applied to a row before it is written, e.g. to set its
	// reconcile status to pending.
	Prepare func(T)
	// Owned limits the rows Sync may delete to those of one writer of a
	// table shared by several (CNP and CCNP reflectors both fill policies).
	Owned func(T) bool
	// Merge returns the row to write from the one the table holds under
	// the same key (found is false when none) and the new one; e.g.
	// KeepLastValid for policies.
	Merge func(old T, found bool, new T) T
	// Gone is called with each row Sync deletes, e.g. to keep what the
	// row held that outlives it.
	Gone func(T)
}

// Sync makes tbl hold exactly rows, among the rows it owns: owned rows not
// wanted are deleted, and a wanted row is written unless the table holds
// one, under the same primary key, that opts.Same accepts, so that readers
// of the table's changes see only real changes. Rows are keyed by the
// table's primary index; of several rows with one key, the last is kept.
// It returns the number of distinct keys of rows.
func Sync[T any](txn statedb.WriteTxn, tbl statedb.RWTable[T], rows []T, opts SyncOptions[T]) int {
	same := opts.Same
	if same == nil {
		same = func(old, new T) bool { return reflect.DeepEqual(old, new) }
	}
	idx := tbl.PrimaryIndexer()
	want := make(map[string]T, len(rows))
	for _, row := range rows {
		key, _ := idx.ObjectToKey(row)
		want[string(key)] = row
	}
	var gone []T // collected first: the table is not changed while iterated
	for row := range tbl.All(txn) {
		key, _ := idx.ObjectToKey(row)
		if _, ok := want[string(key)]; !ok && (opts.Owned == nil || opts.Owned(row)) {
			gone = append(gone, row)
		}
	}
	for _, row := range gone {
		tbl.Delete(txn, row)
		if opts.Gone != nil {
			opts.Gone(row)
		}
	}
	for _, row := range want {
		if q, ok := idx.QueryFromObject(row); ok {
			old, _, found := tbl.Get(txn, q)
			if opts.Merge != nil {
				row = opts.Merge(old, found, row)
			}
			if found && same(old, row) {
				continue
			}
		}
		if opts.Prepare != nil {
			opts.Prepare(row)
		}
		tbl.Insert(txn, row)
	}
	return len(want)
}
