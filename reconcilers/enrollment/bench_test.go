// SPDX-License-Identifier: Apache-2.0

package enrollment

import (
	"fmt"
	"log/slog"
	"net/netip"
	"runtime"
	"testing"

	"github.com/cilium/statedb"

	"github.com/mtlsbridge/mtlsbridge/internal/heapstat"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// The scale of the core issue's benchmark: 100,000 pods on 1,000 nodes in
// 1,000 namespaces, with 1,000 policies (950 CNPs, 50 CCNPs).
const (
	benchPods       = 100_000
	benchNodes      = 1_000
	benchNamespaces = 1_000
	benchCNPs       = 950
	benchCCNPs      = 50
	benchApps       = 10
	// benchLocalNode runs pods 1, 1001, 2001...: 100 pods of namespace
	// ns-1, which is not labelled for mTLS.
	benchLocalNode = "node-1"
)

type benchWorld struct {
	db         *statedb.DB
	pods       statedb.RWTable[*tables.Pod]
	namespaces statedb.RWTable[*tables.Namespace]
	policies   statedb.RWTable[*tables.Policy]
	// cniPods holds only this node's sandboxes: empty for a cluster-wide
	// benchmark, but looked up for every pod.
	cniPods statedb.RWTable[*tables.CNIPod]
	enrolls statedb.RWTable[*Enrollment]
}

func newBenchWorld(tb testing.TB) *benchWorld {
	db := statedb.New()
	w := &benchWorld{db: db}
	var err error
	must := func(e error) {
		if e != nil {
			tb.Fatal(e)
		}
	}
	w.pods, err = tables.NewPodsTable(db, tables.LocalNode{NodeName: benchLocalNode})
	must(err)
	w.namespaces, err = tables.NewNamespacesTable(db)
	must(err)
	w.policies, err = tables.NewPoliciesTable(db)
	must(err)
	w.cniPods, err = tables.NewCNIPodsTable(db)
	must(err)
	w.enrolls, err = NewTable(db, tables.LocalNode{NodeName: benchLocalNode})
	must(err)
	return w
}

func benchPod(i int, extra map[string]string) *tables.Pod {
	ns := fmt.Sprintf("ns-%d", i%benchNamespaces)
	labels := map[string]string{
		"app":               fmt.Sprintf("app-%d", (i/benchNamespaces)%benchApps),
		"tier":              []string{"front", "back"}[i%2],
		"pod-template-hash": fmt.Sprintf("%08x", i/7),
	}
	for k, v := range extra {
		labels[k] = v
	}
	return &tables.Pod{
		Namespace: ns, Name: fmt.Sprintf("pod-%d", i), UID: fmt.Sprintf("uid-%d", i),
		NodeName: fmt.Sprintf("node-%d", i%benchNodes), ServiceAccount: "sa-" + labels["app"],
		Labels: tables.NewLabels(labels), Phase: "Running", Identity: uint32(1000 + i%5000),
		IPs: []netip.Addr{netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)})},
	}
}

func benchPolicy(i int, app int) *tables.Policy {
	requirement := map[string]any{"ingress": []any{map[string]any{"authentication": map[string]any{"mode": "required"}}}}
	if i < benchCNPs {
		spec := map[string]any{"endpointSelector": map[string]any{"matchLabels": map[string]any{"app": fmt.Sprintf("app-%d", app)}}}
		for k, v := range requirement {
			spec[k] = v
		}
		return tables.ParsePolicy(tables.KindCNP, fmt.Sprintf("ns-%d", i), fmt.Sprintf("cnp-%d", i), map[string]any{"spec": spec})
	}
	spec := map[string]any{"endpointSelector": map[string]any{"matchLabels": map[string]any{
		"app": fmt.Sprintf("app-%d", app), "k8s:io.kubernetes.pod.namespace": fmt.Sprintf("ns-%d", i)}}}
	for k, v := range requirement {
		spec[k] = v
	}
	return tables.ParsePolicy(tables.KindCCNP, "", fmt.Sprintf("ccnp-%d", i), map[string]any{"spec": spec})
}

// fill inserts the whole cluster and marks the inputs initialized.
func (w *benchWorld) fill(tb testing.TB) {
	txn := w.db.WriteTxn(w.pods, w.namespaces, w.policies)
	for _, t := range []interface {
		RegisterInitializer(statedb.WriteTxn, string) func(statedb.WriteTxn)
	}{w.pods, w.namespaces, w.policies} {
		t.RegisterInitializer(txn, "bench")(txn)
	}
	for i := range benchNamespaces {
		ns := &tables.Namespace{Name: fmt.Sprintf("ns-%d", i)}
		if i%4 == 0 {
			ns.Labels = tables.NewLabels(map[string]string{tables.NamespaceEnabledLabel: "true"})
		}
		w.namespaces.Insert(txn, ns)
	}
	for i := range benchCNPs + benchCCNPs {
		w.policies.Insert(txn, benchPolicy(i, i%benchApps))
	}
	for i := range benchPods {
		w.pods.Insert(txn, benchPod(i, nil))
	}
	txn.Commit()
}

func (w *benchWorld) derivation(tb testing.TB) *derivation {
	d, err := newDerivation(derivationParams{
		Config: defaultConfig, Node: tables.LocalNode{NodeName: benchLocalNode}, Log: slog.New(slog.DiscardHandler), DB: w.db,
		Pods: w.pods, Namespaces: w.namespaces, Policies: w.policies,
		CNIPods: w.cniPods, Enrollments: w.enrolls,
	})
	if err != nil {
		tb.Fatal(err)
	}
	return d
}

// BenchmarkMemoryPerPod reports the heap held per pod once everything is
// derived: the pods (with their Cilium identities) and enrollments tables
// with their indexes, plus the namespaces and policies shared by all. It
// comes first in the file, so that it runs first: the worlds of the other
// benchmarks outlive them for a while and would blur the measurement.
func BenchmarkMemoryPerPod(b *testing.B) {
	var perPod float64
	for b.Loop() {
		perPod = heapPerPod(b)
	}
	b.ReportMetric(perPod, "B/pod")
}

func heapPerPod(tb testing.TB) float64 {
	heap := heapstat.Settled
	before := heap()
	w := newBenchWorld(tb)
	w.fill(tb)
	w.derivation(tb).Step()
	after := heap()
	runtime.KeepAlive(w)
	return float64(after-before) / benchPods
}

// BenchmarkColdDerivation derives the enrollments of 100,000 pods from a
// cold start: one pass over the initial changes of every input.
func BenchmarkColdDerivation(b *testing.B) {
	for b.Loop() {
		b.StopTimer()
		w := newBenchWorld(b)
		w.fill(b)
		d := w.derivation(b)
		b.StartTimer()

		d.Step()

		b.StopTimer()
		w.checkRows(b)
		if ok, _ := w.enrolls.Initialized(w.db.ReadTxn()); !ok {
			b.Fatal("enrollments not initialized after the first pass")
		}
		b.StartTimer()
	}
}

// checkRows fails unless the enrollments table has a row for each pod of
// this node and for each enrolled pod, and no other.
func (w *benchWorld) checkRows(tb testing.TB) {
	txn := w.db.ReadTxn()
	rows := 0
	for e := range w.enrolls.All(txn) {
		if !e.Enrolled && e.Node != benchLocalNode {
			tb.Fatalf("row of a remote pod that is not enrolled: %+v", e)
		}
		rows++
	}
	local := 0
	for pod := range w.pods.List(txn, tables.PodsOfThisNode()) {
		if _, _, ok := w.enrolls.Get(txn, ByKey(pod.Key())); !ok {
			tb.Fatalf("no row for %s, a pod of this node", pod.Key())
		}
		local++
	}
	if rows < local || rows == local {
		tb.Fatalf("%d rows for %d local pods: no remote pod enrolled", rows, local)
	}
}

// BenchmarkPodChange measures one pod label change reaching its row.
func BenchmarkPodChange(b *testing.B) {
	w := newBenchWorld(b)
	w.fill(b)
	d := w.derivation(b)
	d.Step()
	i := 0
	for b.Loop() {
		// Alternate the opt-out label so every change flips the decision.
		extra := map[string]string{"extra": "x"}
		if i%2 == 0 {
			extra[tables.RedirTypeLabel] = tables.RedirTypeNone
		}
		// A pod of this node (it has a row whether enrolled or not) that
		// runs app-0, which no policy of ns-1 selects.
		pod := benchPod(1+10*benchNodes*(i%10), extra)
		txn := w.db.WriteTxn(w.pods)
		w.pods.Insert(txn, pod)
		txn.Commit()
		d.Step()
		e, _, _ := w.enrolls.Get(w.db.ReadTxn(), ByKey(pod.Key()))
		if (e.Reason == ReasonOptOut) != (i%2 == 0) {
			b.Fatalf("change %d did not reach its row: %+v", i, e)
		}
		i++
	}
}

// BenchmarkPolicyChange measures one CNP changing its selector (from one
// app to another, moving enrollment of about 10 pods) reaching its rows.
func BenchmarkPolicyChange(b *testing.B) {
	w := newBenchWorld(b)
	w.fill(b)
	d := w.derivation(b)
	d.Step()
	i := 0
	for b.Loop() {
		idx := i % benchCNPs
		app := (idx + 1 + i/benchCNPs) % benchApps
		p := benchPolicy(idx, app)
		txn := w.db.WriteTxn(w.policies)
		w.policies.Insert(txn, p)
		txn.Commit()
		d.Step()
		// A pod of that namespace running that app is now enrolled by p
		// (unless an earlier-sorting CCNP already enrolls it).
		pod := benchPod(idx+app*benchNamespaces, nil)
		if pod.Labels.Get("app") != fmt.Sprintf("app-%d", app) {
			b.Fatalf("bench bug: pod %s runs %s", pod.Key(), pod.Labels.Get("app"))
		}
		e, _, _ := w.enrolls.Get(w.db.ReadTxn(), ByKey(pod.Key()))
		if !e.Enrolled || (e.Policy != p.Key() && e.Policy[:4] != "ccnp") {
			b.Fatalf("policy change %d did not reach %s: %+v", i, pod.Key(), e)
		}
		i++
	}
}
