// SPDX-License-Identifier: Apache-2.0

package ingest

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
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
	r := &reflection[*tables.Pod]{
		name: "k8s/pods", expected: &corev1.Pod{}, tables: w, table: w.Pods, kick: make(chan struct{}, 1),
		convert: func(obj any) (*tables.Pod, error) { return podFromK8s(obj.(*corev1.Pod)) },
		log:     slog.New(slog.NewTextHandler(logs, nil)),
	}
	r.lw = cache.ToListWatcherWithWatchListSemantics(r.observeErrors(lw), listThenWatch{})
	txn := w.DB.WriteTxn(w.Pods)
	r.initDone = w.Pods.RegisterInitializer(txn, r.name)
	txn.Commit()
	return r, w
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
