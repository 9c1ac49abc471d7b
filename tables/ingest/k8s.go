// SPDX-License-Identifier: Apache-2.0

package ingest

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/consistencydetector"

	"github.com/mtlsbridge/mtlsbridge/tables"
)

// reflection streams one Kubernetes resource into one table, the way
// Cilium's reflectors do: client-go's Reflector lists and watches, and a
// small store turns its calls into batched write transactions. No informer
// cache: each object is held once, in its table.
type reflection[T any] struct {
	name     string // sources row, e.g. "k8s/pods"
	lw       cache.ListerWatcher
	expected runtime.Object
	convert  func(obj any) (T, error)
	sink     sink[T]
	tables   *writeTables
	initDone func(statedb.WriteTxn)
	log      *slog.Logger

	mu      sync.Mutex
	pending []storeOp[T]
	kick    chan struct{}
}

// storeOp is one call of the Reflector on the store.
type storeOp[T any] struct {
	obj      T
	err      error // conversion problem, shown in the sources row
	deleted  bool
	replace  []T // set for Replace: the full listing
	isList   bool
	watchErr error
	resumed  bool // a list or watch succeeded after failures
}

func (r *reflection[T]) run(ctx context.Context, health cell.Health) error {
	reflector := cache.NewReflectorWithOptions(r.lw, r.expected, (*reflectorStore[T])(r),
		cache.ReflectorOptions{Name: r.name, Backoff: &retryBackoff})
	go reflector.RunWithContext(ctx)

	for {
		select {
		case <-ctx.Done():
			return nil
		case <-r.kick:
		}
		r.mu.Lock()
		ops := r.pending
		r.pending = nil
		r.mu.Unlock()
		r.apply(ops)
		health.OK(r.name)
	}
}

func (r *reflection[T]) push(op storeOp[T]) {
	r.mu.Lock()
	r.pending = append(r.pending, op)
	r.mu.Unlock()
	select {
	case r.kick <- struct{}{}:
	default:
	}
}

// apply writes a batch of store calls in one transaction.
func (r *reflection[T]) apply(ops []storeOp[T]) {
	txn := r.tables.DB.WriteTxn(r.sink.table(), r.tables.Sources)
	defer txn.Commit()
	src, _, found := r.tables.Sources.Get(txn, tables.SourceByName(r.name))
	if found {
		copy := *src
		src = &copy
	} else {
		src = &tables.Source{Name: r.name}
	}
	for _, op := range ops {
		switch {
		case op.watchErr != nil:
			src.Error = "watch: " + op.watchErr.Error()
		case op.resumed:
			src.Error = ""
		case op.isList:
			src.Objects = r.sink.replace(txn, op.replace)
			src.Synced = true
			src.Error = ""
			if r.initDone != nil {
				r.initDone(txn)
				r.initDone = nil
			}
		case op.deleted:
			src.Objects += r.sink.remove(txn, op.obj)
		default:
			src.Objects += r.sink.upsert(txn, op.obj)
		}
		if op.err != nil {
			r.log.Error("Malformed Kubernetes object", "source", r.name, "error", op.err)
			src.Error = op.err.Error()
		}
	}
	r.tables.Sources.Insert(txn, src)
}

// reflectorStore implements cache.ReflectorStore on a reflection.
type reflectorStore[T any] reflection[T]

func (s *reflectorStore[T]) r() *reflection[T] { return (*reflection[T])(s) }

func (s *reflectorStore[T]) Add(obj any) error { return s.Update(obj) }
func (s *reflectorStore[T]) Resync() error     { return nil }
func (s *reflectorStore[T]) Update(obj any) error {
	row, err := s.convert(obj)
	s.r().push(storeOp[T]{obj: row, err: err})
	return nil
}

func (s *reflectorStore[T]) Delete(obj any) error {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	row, _ := s.convert(obj)
	s.r().push(storeOp[T]{obj: row, deleted: true})
	return nil
}

func (s *reflectorStore[T]) Replace(list []any, _ string) error {
	rows := make([]T, 0, len(list))
	var firstErr error
	for _, obj := range list {
		var row T
		var err error
		if c, ok := obj.(*converted[T]); ok {
			row, err = c.row, c.err
		} else { // listed, not streamed
			row, err = s.convert(obj)
		}
		if err != nil && firstErr == nil {
			firstErr = err
		}
		rows = append(rows, row)
	}
	s.r().push(storeOp[T]{replace: rows, isList: true, err: firstErr})
	return nil
}

// Transformer implements cache.TransformingStore. A streamed listing (the
// API server's initial watch events) is held by the Reflector until its
// last object has come, then passed to Replace. Converted as they come,
// the objects held are the rows, a fraction of an API object's size: a
// listing of 100,000 pods does not hold 100,000 Pods of the API. Not with
// client-go's consistency detector on (a debugging aid, set by an
// environment variable): it compares the objects held with a listing's.
func (s *reflectorStore[T]) Transformer() cache.TransformFunc {
	if consistencydetector.IsDataConsistencyDetectionForWatchListEnabled() {
		return nil
	}
	return func(obj any) (any, error) {
		if c, ok := obj.(*converted[T]); ok {
			return c, nil
		}
		row, err := s.convert(obj)
		return &converted[T]{row: row, err: err}, nil
	}
}

// converted is an object of the API as its row, with the problem found
// converting it.
type converted[T any] struct {
	row T
	err error
}

// k8sJobs builds one reflection job per resource mtlsbridge reads, each
// marking its table initialized after its first listing.
func k8sJobs(log *slog.Logger, c *Clients, w *writeTables) []job.Job {
	typed := func(resource string) *cache.ListWatch {
		return cache.NewListWatchFromClient(c.Kube.CoreV1().RESTClient(), resource, metav1.NamespaceAll, fields.Everything())
	}
	custom := func(resource string) *cache.ListWatch {
		return dynamicListWatch(c.Dynamic, ciliumV2.WithResource(resource))
	}
	policy := func(kind tables.PolicyKind) func(any) (*tables.Policy, error) {
		return func(obj any) (*tables.Policy, error) {
			u := obj.(*unstructured.Unstructured)
			return tables.ParsePolicy(kind, u.GetNamespace(), u.GetName(), u.Object), nil
		}
	}
	// CNP and CCNP both fill policies: each replaces only its own rows.
	policySink := func(kind tables.PolicyKind) sink[*tables.Policy] {
		return tableSink[*tables.Policy]{w.Policies, tables.SyncOptions[*tables.Policy]{
			Owned: func(p *tables.Policy) bool { return p.Kind == kind },
			Merge: keepLastValid(log),
		}}
	}
	identities := newIdentities(w.Pods)
	return []job.Job{
		newReflection(log, w, "pods", typed("pods"), c.Kube, &corev1.Pod{},
			func(obj any) (*tables.Pod, error) { return podFromK8s(obj.(*corev1.Pod)) },
			podSink(w.Pods, identities)),
		newReflection(log, w, "ciliumendpoints", custom("ciliumendpoints"), c.Dynamic, &unstructured.Unstructured{},
			func(obj any) (*ciliumEndpoint, error) {
				return endpointFromUnstructured(obj.(*unstructured.Unstructured))
			}, sink[*ciliumEndpoint](identities)),
		newReflection(log, w, "namespaces", typed("namespaces"), c.Kube, &corev1.Namespace{},
			func(obj any) (*tables.Namespace, error) {
				ns := obj.(*corev1.Namespace)
				return tables.NewNamespace(ns.Name, ns.Labels, ns.Annotations), nil
			}, tableSink[*tables.Namespace]{tbl: w.Namespaces}),
		newReflection(log, w, "nodes", typed("nodes"), c.Kube, &corev1.Node{},
			func(obj any) (*tables.Node, error) { return nodeFromK8s(obj.(*corev1.Node)), nil }, tableSink[*tables.Node]{tbl: w.Nodes}),
		newReflection(log, w, "ciliumnetworkpolicies", custom("ciliumnetworkpolicies"), c.Dynamic, &unstructured.Unstructured{},
			policy(tables.KindCNP), policySink(tables.KindCNP)),
		newReflection(log, w, "ciliumclusterwidenetworkpolicies", custom("ciliumclusterwidenetworkpolicies"), c.Dynamic, &unstructured.Unstructured{},
			policy(tables.KindCCNP), policySink(tables.KindCCNP)),
	}
}

func newReflection[T any](log *slog.Logger, w *writeTables, resource string,
	lw *cache.ListWatch, client any, expected runtime.Object, convert func(any) (T, error), sink sink[T]) job.Job {
	r := makeReflection(log, w, "k8s/"+resource, lw, client, expected, convert, sink)
	return job.OneShot("reflect-"+resource, r.run)
}

// makeReflection is the reflection of lw into sink, named name, its
// table's initializer registered; client says whether the API server
// streams the initial listing as watch events.
func makeReflection[T any](log *slog.Logger, w *writeTables, name string,
	lw *cache.ListWatch, client any, expected runtime.Object, convert func(any) (T, error), sink sink[T]) *reflection[T] {
	r := &reflection[T]{
		name: name, expected: expected, convert: convert, sink: sink,
		tables: w, log: log, kick: make(chan struct{}, 1),
	}
	r.lw = cache.ToListWatcherWithWatchListSemantics(r.observeErrors(lw), client)
	txn := w.DB.WriteTxn(sink.table())
	r.initDone = sink.table().RegisterInitializer(txn, r.name)
	txn.Commit()
	return r
}

// retryBackoff paces the retries of a list or watch that failed. client-go's
// default grows to 30-60 s, so that after an API server restart (an upgrade)
// the node ran on stale pods and policies for a minute or more; these
// retries come every 3 to 4.5 s at most (a few requests per node and
// second during an outage, for six resources), and the jitter spreads the
// nodes of a cluster.
var retryBackoff = wait.Backoff{Duration: 200 * time.Millisecond, Factor: 2, Jitter: 0.5, Cap: 3 * time.Second, Steps: 100}

// observeErrors records failed list and watch calls in the sources row
// (client-go's Reflector only logs them) and passes them on for its
// retry. The first failure (the watch lost) and the first success after
// failures (resumed, with how long it took) are logged; the retries in
// between only at debug level.
func (r *reflection[T]) observeErrors(lw *cache.ListWatch) *cache.ListWatch {
	list, watchFn := lw.ListWithContextFunc, lw.WatchFuncWithContext
	var lostAt atomic.Pointer[time.Time]
	report := func(err error) {
		if err == nil {
			if at := lostAt.Swap(nil); at != nil {
				r.log.Info("Kubernetes watch resumed", "source", r.name, "after", time.Since(*at).Round(time.Millisecond))
				r.push(storeOp[T]{resumed: true})
			}
			return
		}
		now := time.Now()
		if lostAt.CompareAndSwap(nil, &now) {
			r.log.Warn("Kubernetes watch lost, retrying", "source", r.name, "error", err)
		} else {
			r.log.Debug("Kubernetes list/watch failed again, retrying", "source", r.name, "error", err)
		}
		r.push(storeOp[T]{watchErr: err})
	}
	return &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, opts metav1.ListOptions) (runtime.Object, error) {
			obj, err := list(ctx, opts)
			report(err)
			return obj, err
		},
		WatchFuncWithContext: func(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error) {
			w, err := watchFn(ctx, opts)
			report(err)
			return w, err
		},
		DisableChunking: lw.DisableChunking,
	}
}

func dynamicListWatch(dyn dynamic.Interface, gvr schema.GroupVersionResource) *cache.ListWatch {
	res := dyn.Resource(gvr)
	return &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, opts metav1.ListOptions) (runtime.Object, error) {
			return res.List(ctx, opts)
		},
		WatchFuncWithContext: func(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error) {
			return res.Watch(ctx, opts)
		},
	}
}
