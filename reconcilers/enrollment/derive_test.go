// SPDX-License-Identifier: Apache-2.0

package enrollment

import (
	"testing"

	"github.com/mtlsbridge/mtlsbridge/tables"
)

// TestNamespaceChangeAfterFirstUpdate: before its first update the
// derivation relies on every pod being dirty by its own change, and
// ignores the pods a namespace would touch; after it, a namespace change
// must reach its pods.
func TestNamespaceChangeAfterFirstUpdate(t *testing.T) {
	w := newBenchWorld(t)
	d := w.derivation(t)
	insertNamespace := func(labels map[string]string) {
		txn := w.db.WriteTxn(w.namespaces)
		w.namespaces.Insert(txn, &tables.Namespace{Name: "ns-1", Labels: tables.NewLabels(labels)})
		txn.Commit()
	}
	insertNamespace(nil)
	d.Step() // no pod yet: nothing to update

	txn := w.db.WriteTxn(w.pods)
	pod := benchPod(1, nil) // in ns-1, on this node
	w.pods.Insert(txn, pod)
	txn.Commit()
	d.Step()
	if e, _, _ := w.enrolls.Get(w.db.ReadTxn(), ByKey(pod.Key())); e == nil || e.Reason != ReasonNotSelected {
		t.Fatalf("before the namespace label: %+v", e)
	}

	insertNamespace(map[string]string{tables.NamespaceEnabledLabel: "true"})
	d.Step()
	if e, _, _ := w.enrolls.Get(w.db.ReadTxn(), ByKey(pod.Key())); e == nil || e.Reason != ReasonNamespaceLabel {
		t.Fatalf("after the namespace label: %+v", e)
	}
}
