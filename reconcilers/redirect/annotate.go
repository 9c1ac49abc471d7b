// SPDX-License-Identifier: Apache-2.0

package redirect

import (
	"context"
	"encoding/json"
	"fmt"
	"iter"
	"log/slog"
	"net/netip"
	"strconv"
	"strings"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
	"github.com/cilium/statedb/reconciler"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/mtlsbridge/mtlsbridge/bpf"
	"github.com/mtlsbridge/mtlsbridge/reconcilers"
	"github.com/mtlsbridge/mtlsbridge/tables"
	"github.com/mtlsbridge/mtlsbridge/tables/source"
)

// AnnotationsTableName is the name of the table of published readiness.
const AnnotationsTableName = "ready-annotations"

// ReadyAnnotation is what the agent publishes on a local pod: Ready sets
// annotation mtlsbridge.io/redirect=ready, not Ready removes it. Only pods
// whose annotation is, or must become, set have a row.
type ReadyAnnotation struct {
	Pod    string
	Ready  bool
	Status reconciler.Status
}

func (r *ReadyAnnotation) clone() *ReadyAnnotation { c := *r; return &c }

func (r *ReadyAnnotation) TableHeader() []string { return []string{"Pod", "Ready", "Status"} }

func (r *ReadyAnnotation) TableRow() []string {
	return []string{r.Pod, strconv.FormatBool(r.Ready), statusString(r.Status)}
}

var (
	annotationPodIndex = statedb.Index[*ReadyAnnotation, string]{
		Name:       "pod",
		FromObject: func(r *ReadyAnnotation) index.KeySet { return index.NewKeySet(index.String(r.Pod)) },
		FromKey:    index.String,
		FromString: index.FromString,
		Unique:     true,
	}
	// ReadyAnnotationByPod queries the row of a pod ("namespace/name").
	ReadyAnnotationByPod = annotationPodIndex.Query
)

// NewAnnotationsTable creates the ready-annotations table.
func NewAnnotationsTable(db *statedb.DB) (statedb.RWTable[*ReadyAnnotation], error) {
	return statedb.NewTable(db, AnnotationsTableName, annotationPodIndex)
}

type annotationParams struct {
	cell.In

	Config      Config
	Node        tables.LocalNode
	Log         *slog.Logger
	DB          *statedb.DB
	Jobs        job.Group
	Params      reconciler.Params
	Clients     *source.Clients
	Pods        statedb.Table[*tables.Pod]
	CNIPods     statedb.Table[*tables.CNIPod]
	Redirects   statedb.Table[*Redirect]
	Attachments statedb.Table[*Attachment]
	Annotations statedb.RWTable[*ReadyAnnotation]
}

// registerAnnotations keeps the ready-annotations table derived (this
// node's xDS reads it for its own pods) and, in Kubernetes mode, publishes
// it on the pods: other nodes read it to decide whether to send HBONE.
func registerAnnotations(p annotationParams) error {
	if !p.Config.EnableRedirect {
		return nil
	}
	p.Jobs.Add(job.OneShot("derive-ready-annotations", (&readiness{annotationParams: p}).run))
	if p.Clients == nil {
		return nil
	}
	_, err := reconciler.Register(p.Params, p.Annotations,
		(*ReadyAnnotation).clone,
		func(r *ReadyAnnotation, s reconciler.Status) *ReadyAnnotation { r.Status = s; return r },
		func(r *ReadyAnnotation) reconciler.Status { return r.Status },
		&AnnotationOps{clients: p.Clients, pods: p.Pods},
		nil,
		reconciler.WithName("annotate"),
		reconciler.WithRetry(time.Second, time.Minute),
	)
	if err != nil {
		return fmt.Errorf("annotations reconciler: %w", err)
	}
	return nil
}

// readiness keeps the ready-annotations table derived.
type readiness struct{ annotationParams }

func (r *readiness) run(ctx context.Context, health cell.Health) error {
	// Readiness is judged on the rows of this agent only once they exist:
	// before, every pod would look not ready.
	if !reconcilers.WaitInitialized(ctx, health, r.DB, r.Pods, r.CNIPods, r.Redirects, r.Attachments) {
		return nil
	}
	for {
		wtxn := r.DB.WriteTxn(r.Annotations)
		pods, podsWatch := r.Pods.ListWatch(wtxn, tables.PodsByNode(r.Node.NodeName))
		_, redirectsWatch := r.Redirects.AllWatch(wtxn)
		_, attachmentsWatch := r.Attachments.AllWatch(wtxn)
		_, cniPodsWatch := r.CNIPods.AllWatch(wtxn)
		want := map[string]bool{}
		agent := readinessOf(r.Redirects.List(wtxn, RedirectByAddr(bpf.AgentKey)), bpf.KindAgent)
		for pod := range pods {
			addrs := tables.PodAddrs(wtxn, r.CNIPods, pod)
			state := agent.and(podReadiness(wtxn, r.Redirects, r.Attachments, pod.Key(), addrs))
			switch {
			case state == ready:
				want[pod.Key()] = true
			case state == notReady && pod.RedirectReady:
				want[pod.Key()] = false
			case state == settling && pod.RedirectReady:
				// Keep what is published while statuses settle (an agent
				// restart makes every row pending once).
				if old, _, ok := r.Annotations.Get(wtxn, ReadyAnnotationByPod(pod.Key())); ok {
					want[pod.Key()] = old.Ready
				}
			}
		}
		rows := make(map[string]*ReadyAnnotation, len(want))
		for pod, ready := range want {
			rows[pod] = &ReadyAnnotation{Pod: pod, Ready: ready}
		}
		reconcilers.Sync(wtxn, r.Annotations, rows,
			func(a *ReadyAnnotation) string { return a.Pod },
			func(old, new *ReadyAnnotation) bool { return old.Ready == new.Ready },
			func(a *ReadyAnnotation) { a.Status = reconciler.StatusPending() })
		wtxn.Commit()
		health.OK(fmt.Sprintf("%d pods to publish", len(want)))
		select {
		case <-ctx.Done():
			return nil
		case <-podsWatch:
		case <-redirectsWatch:
		case <-attachmentsWatch:
		case <-cniPodsWatch:
		}
	}
}

// readinessState of a pod's datapath.
type readinessState int

const (
	ready    readinessState = iota
	settling                // some row is pending: the outcome is not known yet
	notReady                // not enrolled, or a row failed or is missing
)

func (s readinessState) and(o readinessState) readinessState { return max(s, o) }

// readinessOf folds the statuses of rows that must all be done, and of kind
// kind for redirects.
func readinessOf[T interface{ *Redirect | *Attachment }](rows iter.Seq2[T, statedb.Revision], kind bpf.Kind) readinessState {
	state, seen := ready, false
	for row := range rows {
		seen = true
		var status reconciler.Status
		switch r := any(row).(type) {
		case *Redirect:
			if r.Kind != kind {
				return notReady
			}
			status = r.Status
		case *Attachment:
			status = r.Status
		}
		switch status.Kind {
		case reconciler.StatusKindDone:
		case reconciler.StatusKindError:
			return notReady
		default:
			state = settling
		}
	}
	if !seen {
		return notReady
	}
	return state
}

// podReadiness: every address of the pod has a done enrolled entry of the
// pod, and the pod's interface has the from-pod program.
func podReadiness(txn statedb.ReadTxn, redirects statedb.Table[*Redirect], attachments statedb.Table[*Attachment],
	pod string, addrs []netip.Addr) readinessState {
	if len(addrs) == 0 {
		return notReady
	}
	state := readinessOf(attachments.List(txn, AttachmentsByPod(pod)), 0)
	for _, ip := range addrs {
		row, _, ok := redirects.Get(txn, RedirectByAddr(ip))
		if !ok || row.Pod != pod {
			return notReady
		}
		state = state.and(readinessOf(func(yield func(*Redirect, statedb.Revision) bool) { yield(row, 0) }, bpf.KindEnrolled))
	}
	return state
}

// Redirected reports whether the redirection of a pod's addresses is in
// the kernel: the agent's entry, an enrolled entry of the pod for each
// address, and the from-pod program on its interface, all done. The CNI
// route asks it for the addresses of the sandbox being added.
func Redirected(txn statedb.ReadTxn, redirects statedb.Table[*Redirect], attachments statedb.Table[*Attachment],
	pod string, addrs []netip.Addr) bool {
	agent := readinessOf(redirects.List(txn, RedirectByAddr(bpf.AgentKey)), bpf.KindAgent)
	return agent.and(podReadiness(txn, redirects, attachments, pod, addrs)) == ready
}

// AnnotationOps sets and removes the annotation on pods.
type AnnotationOps struct {
	clients *source.Clients
	pods    statedb.Table[*tables.Pod]
}

var _ reconciler.Operations[*ReadyAnnotation] = (*AnnotationOps)(nil)

// Update implements reconciler.Operations. A pod that already shows the
// wanted state, or is gone, needs no call.
func (o *AnnotationOps) Update(ctx context.Context, txn statedb.ReadTxn, _ statedb.Revision, r *ReadyAnnotation) error {
	pod, _, ok := o.pods.Get(txn, tables.PodByKey(r.Pod))
	if !ok || pod.RedirectReady == r.Ready {
		return nil
	}
	var value any // JSON null removes the annotation
	if r.Ready {
		value = tables.RedirectReadyValue
	}
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": map[string]any{tables.RedirectAnnotation: value}}})
	if err != nil {
		return err
	}
	ns, name, _ := strings.Cut(r.Pod, "/")
	_, err = o.clients.Kube.CoreV1().Pods(ns).Patch(ctx, name, types.MergePatchType, patch, metav1.PatchOptions{})
	if apierrors.IsNotFound(err) {
		return nil
	}
	return err
}

// Delete implements reconciler.Operations: a row goes once the pod shows
// no annotation, or is gone; nothing is left to do.
func (o *AnnotationOps) Delete(context.Context, statedb.ReadTxn, statedb.Revision, *ReadyAnnotation) error {
	return nil
}

// Prune implements reconciler.Operations: the rows cover every local pod
// that carries the annotation, so there is nothing else to remove.
func (o *AnnotationOps) Prune(context.Context, statedb.ReadTxn, iter.Seq2[*ReadyAnnotation, statedb.Revision]) error {
	return nil
}
