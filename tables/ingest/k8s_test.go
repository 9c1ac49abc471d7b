// SPDX-License-Identifier: Apache-2.0

package ingest

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math/rand"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/tools/cache"

	"github.com/mtlsbridge/mtlsbridge/internal/syncbuf"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// podReflection is the pods reflection of a k8s source, on lw.
func podReflection(t *testing.T, db *statedb.DB, lw *cache.ListWatch, logs *syncbuf.Buffer) (*reflection[*tables.Pod], *writeTables) {
	w, err := newWriteTables(db, tables.LocalNode{NodeName: "node-a"}, slog.New(slog.DiscardHandler))
	must(t, err)
	return testPodReflection(w, lw, logs, newIdentities(w.Pods)), w
}

func testPodReflection(w *writeTables, lw *cache.ListWatch, logs *syncbuf.Buffer, ids *identities) *reflection[*tables.Pod] {
	return makeReflection(slog.New(slog.NewTextHandler(logs, nil)), w, "k8s/pods", lw, listThenWatch{}, &corev1.Pod{},
		func(obj any) (*tables.Pod, error) { return podFromK8s(obj.(*corev1.Pod)) }, podSink(w.Pods, ids))
}

// listThenWatch makes the Reflector list, then watch (a stream of watch
// events without the API server's initial-events bookmark).
type listThenWatch struct{}

func (listThenWatch) IsWatchListSemanticsUnSupported() bool { return true }

// commitCounter counts the write transactions on the pods table.
type commitCounter struct {
	statedb.NopMetrics
	commits atomic.Int32
}

func (c *commitCounter) WriteTxnDuration(_ string, tables []string, _ time.Duration) {
	if slices.Contains(tables, "pods") {
		c.commits.Add(1)
	}
}

func k8sPod(name string, ips ...string) *corev1.Pod {
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "app", Name: name, ResourceVersion: "1"}}
	for _, ip := range ips {
		p.Status.PodIPs = append(p.Status.PodIPs, corev1.PodIP{IP: ip})
	}
	return p
}

func sourceRow(w *writeTables, name string) tables.Source {
	src, _, ok := w.Sources.Get(w.DB.ReadTxn(), tables.SourceByName(name))
	if !ok {
		return tables.Source{}
	}
	return *src
}

// The reflector's calls that arrive together are written in one
// transaction; an object with a bad field is kept with what parses, and
// its error shows in the source's row and the log.
func TestReflectionBatchesAndKeepsBadObjects(t *testing.T) {
	logs := &syncbuf.Buffer{}
	commits := &commitCounter{}
	r, w := podReflection(t, statedb.New(statedb.WithMetrics(commits)), &cache.ListWatch{}, logs)
	store := (*reflectorStore[*tables.Pod])(r)

	must(t, store.Replace([]any{k8sPod("a", "10.0.0.1"), k8sPod("bad", "10.0.0.1", "10.0.0.999")}, "1"))
	const added = 500
	for i := range added {
		must(t, store.Add(k8sPod(fmt.Sprintf("p%d", i), fmt.Sprintf("10.1.%d.%d", i/250, i%250+1))))
	}
	must(t, store.Delete(k8sPod("a")))
	before := commits.commits.Load()
	r.apply(r.pending)
	if n := commits.commits.Load() - before; n != 1 {
		t.Errorf("%d calls were written in %d transactions, want 1", added+3, n)
	}

	txn := w.DB.ReadTxn()
	if ok, _ := w.Pods.Initialized(txn); !ok {
		t.Error("pods not initialized after the first listing")
	}
	if _, _, ok := w.Pods.Get(txn, tables.PodByKey("app/a")); ok {
		t.Error("app/a still in the table after its deletion")
	}
	bad, _, ok := w.Pods.Get(txn, tables.PodByKey("app/bad"))
	if !ok || len(bad.IPs) != 1 || bad.IPs[0].String() != "10.0.0.1" {
		t.Errorf("app/bad: %+v, want it kept with its one valid address", bad)
	}
	src := sourceRow(w, "k8s/pods")
	if src.Objects != added+1 || !src.Synced || !strings.Contains(src.Error, `bad IP "10.0.0.999"`) {
		t.Errorf("sources row: %+v, want %d objects, synced, the bad address named", src, added+1)
	}
	if !strings.Contains(logs.String(), "Malformed Kubernetes object") {
		t.Errorf("the bad object was not logged:\n%s", logs)
	}
}

// Through client-go's Reflector: the listing, then watch events, reach the
// table; a failed list shows in the sources row until a retry succeeds.
func TestReflectionFollowsListAndWatch(t *testing.T) {
	watcher := watch.NewFake()
	lists := 0
	lw := &cache.ListWatch{
		ListWithContextFunc: func(context.Context, metav1.ListOptions) (runtime.Object, error) {
			lists++
			if lists == 1 {
				return nil, errors.New("connection refused")
			}
			return &corev1.PodList{ListMeta: metav1.ListMeta{ResourceVersion: "1"}, Items: []corev1.Pod{*k8sPod("a", "10.0.0.1")}}, nil
		},
		WatchFuncWithContext: func(context.Context, metav1.ListOptions) (watch.Interface, error) { return watcher, nil },
	}
	logs := &syncbuf.Buffer{}
	r, w := podReflection(t, statedb.New(), lw, logs)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	health, _ := cell.NewSimpleHealth()
	go func() { r.run(ctx, health); close(done) }()
	t.Cleanup(func() { cancel(); <-done })

	waitPods := func(what string, cond func(txn statedb.ReadTxn) bool) {
		t.Helper()
		deadline := time.After(10 * time.Second)
		for {
			txn := w.DB.ReadTxn()
			if cond(txn) {
				return
			}
			_, watch := w.Pods.AllWatch(txn)
			select {
			case <-watch:
			case <-time.After(50 * time.Millisecond): // the sources row changes too
			case <-deadline:
				t.Fatalf("timed out waiting for %s; source %+v; logs:\n%s", what, sourceRow(w, "k8s/pods"), logs)
			}
		}
	}
	has := func(txn statedb.ReadTxn, name string) bool {
		_, _, ok := w.Pods.Get(txn, tables.PodByKey("app/"+name))
		return ok
	}

	waitPods("the listing after a failed one", func(txn statedb.ReadTxn) bool { return has(txn, "a") })
	if src := sourceRow(w, "k8s/pods"); src.Error != "" || !src.Synced {
		t.Errorf("sources row after the retry: %+v, want synced without error", src)
	}
	for _, want := range []string{"Kubernetes watch lost", "connection refused", "Kubernetes watch resumed"} {
		if !strings.Contains(logs.String(), want) {
			t.Errorf("log lacks %q:\n%s", want, logs)
		}
	}

	watcher.Add(k8sPod("b", "10.0.0.2"))
	watcher.Delete(k8sPod("a", "10.0.0.1"))
	waitPods("b added and a deleted", func(txn statedb.ReadTxn) bool { return has(txn, "b") && !has(txn, "a") })
	if src := sourceRow(w, "k8s/pods"); src.Objects != 1 {
		t.Errorf("sources row counts %d objects, want 1", src.Objects)
	}
}

// A listing the API server streams as watch events (watch-list) is
// converted while it streams: until the bookmark that ends it, the
// Reflector holds rows, not Pods of the API. Then the rows reach the table
// as one listing, a bad object with its error.
func TestReflectionConvertsAStreamedListing(t *testing.T) {
	const streamed = 100
	watcher := watch.NewFakeWithChanSize(streamed+1, false)
	lw := &cache.ListWatch{
		ListWithContextFunc: func(context.Context, metav1.ListOptions) (runtime.Object, error) {
			return nil, errors.New("listed: want the listing streamed")
		},
		WatchFuncWithContext: func(_ context.Context, opts metav1.ListOptions) (watch.Interface, error) {
			if opts.SendInitialEvents == nil || !*opts.SendInitialEvents {
				return nil, errors.New("a watch without initial events: want the listing streamed")
			}
			return watcher, nil
		},
	}
	w, err := newWriteTables(statedb.New(), tables.LocalNode{NodeName: "node-a"}, slog.New(slog.DiscardHandler))
	must(t, err)
	var conversions atomic.Int32
	logs := &syncbuf.Buffer{}
	// Any client but one that says it cannot stream: client-go streams.
	r := makeReflection(slog.New(slog.NewTextHandler(logs, nil)), w, "k8s/pods", lw, struct{}{}, &corev1.Pod{},
		func(obj any) (*tables.Pod, error) {
			conversions.Add(1)
			return podFromK8s(obj.(*corev1.Pod))
		}, podSink(w.Pods, newIdentities(w.Pods)))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	health, _ := cell.NewSimpleHealth()
	go func() { r.run(ctx, health); close(done) }()
	t.Cleanup(func() { cancel(); <-done })

	for i := range streamed - 1 {
		watcher.Add(k8sPod(fmt.Sprintf("p%d", i), fmt.Sprintf("10.1.0.%d", i+1)))
	}
	watcher.Add(k8sPod("bad", "10.0.0.999"))
	for deadline := time.Now().Add(10 * time.Second); conversions.Load() < streamed; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d streamed pods converted before the listing ended; logs:\n%s", conversions.Load(), streamed, logs)
		}
	}
	if n := w.Pods.NumObjects(w.DB.ReadTxn()); n != 0 {
		t.Fatalf("%d pods in the table before the listing ended", n)
	}

	end := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{ResourceVersion: "2",
		Annotations: map[string]string{metav1.InitialEventsAnnotationKey: "true"}}}
	watcher.Action(watch.Bookmark, end)
	for deadline := time.Now().Add(10 * time.Second); !sourceRow(w, "k8s/pods").Synced; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the streamed listing never reached the table; logs:\n%s", logs)
		}
	}
	if n := w.Pods.NumObjects(w.DB.ReadTxn()); n != streamed {
		t.Errorf("%d pods in the table, want %d", n, streamed)
	}
	if src := sourceRow(w, "k8s/pods"); !strings.Contains(src.Error, `bad IP "10.0.0.999"`) {
		t.Errorf("sources row: %+v, want the bad address named", src)
	}
	if n := conversions.Load(); n != streamed {
		t.Errorf("%d conversions for %d pods, want each converted once", n, streamed)
	}
}

func k8sEndpoint(name string, identity int64) *unstructured.Unstructured {
	u := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "cilium.io/v2", "kind": "CiliumEndpoint",
		"metadata": map[string]any{"namespace": "app", "name": name, "resourceVersion": "1"},
	}}
	if identity != 0 {
		u.Object["status"] = map[string]any{"identity": map[string]any{"id": identity}}
	}
	return u
}

// joinWorld is a pods and a CiliumEndpoints reflection writing one pods
// table, fed through their Reflector stores.
type joinWorld struct {
	w        *writeTables
	ids      *identities
	pods     *reflection[*tables.Pod]
	eps      *reflection[*ciliumEndpoint]
	podStore *reflectorStore[*tables.Pod]
	epStore  *reflectorStore[*ciliumEndpoint]
}

func newJoinWorld(t *testing.T) *joinWorld {
	logs := &syncbuf.Buffer{}
	w, err := newWriteTables(statedb.New(), tables.LocalNode{NodeName: "node-a"}, slog.New(slog.DiscardHandler))
	must(t, err)
	ids := newIdentities(w.Pods)
	pods := testPodReflection(w, &cache.ListWatch{}, logs, ids)
	eps := makeReflection(slog.New(slog.NewTextHandler(logs, nil)), w, "k8s/ciliumendpoints", &cache.ListWatch{}, listThenWatch{},
		&unstructured.Unstructured{}, func(obj any) (*ciliumEndpoint, error) {
			return endpointFromUnstructured(obj.(*unstructured.Unstructured))
		},
		sink[*ciliumEndpoint](ids))
	return &joinWorld{w: w, ids: ids, pods: pods, eps: eps,
		podStore: (*reflectorStore[*tables.Pod])(pods), epStore: (*reflectorStore[*ciliumEndpoint])(eps)}
}

// apply writes what each reflection received, the pods' batch first when
// podsFirst: the two are written in any order.
func (j *joinWorld) apply(podsFirst bool) {
	pods := func() { j.pods.apply(j.pods.pending); j.pods.pending = nil }
	eps := func() { j.eps.apply(j.eps.pending); j.eps.pending = nil }
	if podsFirst {
		pods()
		eps()
	} else {
		eps()
		pods()
	}
}

// The pods and the CiliumEndpoints reflections write one row: each pod
// carries its endpoint's identity, whichever of the two came first, keeps
// it through its own updates, and loses it with its endpoint. The pods
// table is initialized once both have listed.
func TestIdentitiesJoinPodsAndEndpoints(t *testing.T) {
	j := newJoinWorld(t)
	w, podStore, epStore := j.w, j.podStore, j.epStore
	apply := func() { j.apply(false) }
	check := func(what string, want map[string]uint32, endpoints int) {
		t.Helper()
		txn := w.DB.ReadTxn()
		for name, id := range want {
			pod, _, ok := w.Pods.Get(txn, tables.PodByKey("app/"+name))
			if !ok || pod.Identity != id {
				t.Errorf("%s: app/%s = %+v, want identity %d", what, name, pod, id)
			}
		}
		if src := sourceRow(w, "k8s/ciliumendpoints"); src.Objects != endpoints {
			t.Errorf("%s: sources row counts %d endpoints with an identity, want %d", what, src.Objects, endpoints)
		}
	}

	// The endpoints list first: a's identity waits for its pod, b has none yet.
	must(t, epStore.Replace([]any{k8sEndpoint("a", 100), k8sEndpoint("b", 0), k8sEndpoint("gone", 300)}, "1"))
	apply()
	if ok, _ := w.Pods.Initialized(w.DB.ReadTxn()); ok {
		t.Error("pods initialized before the pods' listing")
	}
	must(t, podStore.Replace([]any{k8sPod("a", "10.0.0.1"), k8sPod("b", "10.0.0.2"), k8sPod("c", "10.0.0.3")}, "1"))
	apply()
	if ok, _ := w.Pods.Initialized(w.DB.ReadTxn()); !ok {
		t.Error("pods not initialized after both listings")
	}
	check("after both listings", map[string]uint32{"a": 100, "b": 0, "c": 0}, 2)

	// A pod's own update keeps its identity; an endpoint's update sets it.
	relabelled := k8sPod("a", "10.0.0.1")
	relabelled.Labels = map[string]string{"app": "web"}
	must(t, podStore.Update(relabelled))
	must(t, epStore.Update(k8sEndpoint("b", 200)))
	apply()
	check("after updates", map[string]uint32{"a": 100, "b": 200}, 3)

	// A pod deleted and created again before its endpoint goes finds the
	// identity again, as a new endpoint of the same name would give it;
	// then the endpoint goes, and the identity with it.
	must(t, podStore.Delete(k8sPod("a")))
	apply()
	check("pod a deleted", nil, 3)
	must(t, podStore.Add(k8sPod("a", "10.0.0.9")))
	apply()
	check("pod a back", map[string]uint32{"a": 100}, 3)
	must(t, epStore.Delete(k8sEndpoint("a", 100)))
	apply()
	check("endpoint a deleted", map[string]uint32{"a": 0}, 2)

	// A new listing without b's endpoint clears b's identity and forgets
	// the endpoint whose pod never came.
	must(t, epStore.Replace([]any{k8sEndpoint("c", 400)}, "2"))
	apply()
	check("after a relisting", map[string]uint32{"a": 0, "b": 0, "c": 400}, 1)
	must(t, podStore.Add(k8sPod("gone", "10.0.0.4")))
	apply()
	check("the pod of a forgotten endpoint", map[string]uint32{"gone": 0}, 1)
}

// Whatever the order of pod and endpoint events and listings, and of the
// two reflections' batches, each pod row carries its endpoint's identity,
// what waits is exactly the identities of endpoints without a pod, and
// the sources row counts the endpoints with an identity.
func TestIdentitiesFollowAnyOrder(t *testing.T) {
	names := []string{"a", "b", "c", "d"}
	for seed := range int64(200) {
		rng := rand.New(rand.NewSource(seed))
		j := newJoinWorld(t)
		// What the API server holds: pods by name, endpoints' identities.
		pods, eps := map[string]bool{}, map[string]uint32{}
		identity := func() uint32 { return []uint32{0, 100, 101, 102}[rng.Intn(4)] }
		relistPods := func() {
			clear(pods)
			var list []any
			for _, n := range names {
				if rng.Intn(2) == 0 {
					pods[n] = true
					list = append(list, k8sPod(n, "10.0.0.1"))
				}
			}
			must(t, j.podStore.Replace(list, "1"))
		}
		relistEndpoints := func() {
			clear(eps)
			var list []any
			for _, n := range names {
				if rng.Intn(2) == 0 {
					eps[n] = identity()
					list = append(list, k8sEndpoint(n, int64(eps[n])))
				}
			}
			must(t, j.epStore.Replace(list, "1"))
		}
		var history []string
		relistPods()
		relistEndpoints()
		for step := range 60 {
			n := names[rng.Intn(len(names))]
			switch op := rng.Intn(6); op {
			case 0:
				pods[n] = true
				must(t, j.podStore.Update(k8sPod(n, "10.0.0.1")))
				history = append(history, "pod "+n)
			case 1:
				delete(pods, n)
				must(t, j.podStore.Delete(k8sPod(n)))
				history = append(history, "-pod "+n)
			case 2:
				eps[n] = identity()
				must(t, j.epStore.Update(k8sEndpoint(n, int64(eps[n]))))
				history = append(history, fmt.Sprintf("ep %s=%d", n, eps[n]))
			case 3:
				delete(eps, n)
				must(t, j.epStore.Delete(k8sEndpoint(n, 0)))
				history = append(history, "-ep "+n)
			case 4:
				relistPods()
				history = append(history, fmt.Sprintf("pods %v", slices.Sorted(maps.Keys(pods))))
			case 5:
				relistEndpoints()
				history = append(history, fmt.Sprintf("eps %v", eps))
			}
			if rng.Intn(3) > 0 {
				continue // more events in the same batches
			}
			j.apply(rng.Intn(2) == 0)
			txn := j.w.DB.ReadTxn()
			waiting, withIdentity := 0, 0
			for _, n := range names {
				row, _, found := j.w.Pods.Get(txn, tables.PodByKey("app/"+n))
				if found != pods[n] || (found && row.Identity != eps[n]) {
					t.Fatalf("seed %d step %d: app/%s row %+v (found %v), want found %v with identity %d; events since the last check: %v",
						seed, step, n, row, found, pods[n], eps[n], history)
				}
				if eps[n] != 0 {
					withIdentity++
					if !pods[n] {
						waiting++
					}
				}
			}
			if len(j.ids.waiting) != waiting {
				t.Fatalf("seed %d step %d: %d identities waiting (%v), want %d; events since the last check: %v", seed, step, len(j.ids.waiting), j.ids.waiting, waiting, history)
			}
			if src := sourceRow(j.w, "k8s/ciliumendpoints"); src.Objects != withIdentity {
				t.Fatalf("seed %d step %d: sources row counts %d, want %d; events since the last check: %v", seed, step, src.Objects, withIdentity, history)
			}
			history = history[:0]
		}
	}
}
