// SPDX-License-Identifier: Apache-2.0

package readiness

import (
	"context"
	"encoding/json"
	"fmt"
	"iter"
	"strings"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/mtlsbridge/mtlsbridge/tables"
	"github.com/mtlsbridge/mtlsbridge/tables/ingest"
)

type publisherParams struct {
	cell.In

	Params  reconciler.Params
	Mode    ingest.Mode
	Clients *ingest.Clients
	Pods    statedb.Table[*tables.Pod]
	Table   statedb.RWTable[*ReadyAnnotation]
}

// registerPublisher writes the table onto the pods' annotations, in
// Kubernetes mode only: a manifest folder has no pods to annotate.
func registerPublisher(p publisherParams) error {
	if p.Mode != ingest.Kubernetes {
		return nil
	}
	_, err := reconciler.Register(p.Params, p.Table,
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

// AnnotationOps sets and removes the annotation on pods.
type AnnotationOps struct {
	clients *ingest.Clients
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
