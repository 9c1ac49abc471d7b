// SPDX-License-Identifier: Apache-2.0

package readiness

import (
	"encoding/json"
	"strconv"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
	"github.com/cilium/statedb/reconciler"

	"github.com/mtlsbridge/mtlsbridge/tables"
)

// TableName is the name of the table of published readiness.
const TableName = "ready-annotations"

// ReadyAnnotation is what the agent publishes on a local pod: Ready sets
// annotation mtlsbridge.io/redirect=ready, not Ready removes it. Only pods
// whose annotation is, or must become, set have a row.
type ReadyAnnotation struct {
	Pod   string `json:"pod"`
	Ready bool   `json:"ready"`
	// Shown is what the pod shows now (the annotation is set). A row
	// whose pod shows otherwise than published (someone removed the
	// annotation) is published again.
	Shown bool `json:"shown"`
	// Status is that of publishing the annotation (Kubernetes mode).
	Status reconciler.Status `json:"-"`
}

func (r *ReadyAnnotation) Scope() tables.Scope { return tables.PodScope(r.Pod, "") }

// MarshalJSON shows the row in the names every table uses.
func (r *ReadyAnnotation) MarshalJSON() ([]byte, error) {
	return json.Marshal(struct {
		Pod    string            `json:"pod"`
		Ready  bool              `json:"ready"`
		Shown  bool              `json:"shown"`
		Status tables.StatusJSON `json:"status"`
	}{r.Pod, r.Ready, r.Shown, tables.NewStatusJSON(r.Status)})
}

func (r *ReadyAnnotation) clone() *ReadyAnnotation { c := *r; return &c }

func (r *ReadyAnnotation) TableHeader() []string { return []string{"Pod", "Ready", "Shown", "Status"} }

func (r *ReadyAnnotation) TableRow() []string {
	return []string{r.Pod, strconv.FormatBool(r.Ready), strconv.FormatBool(r.Shown), tables.StatusString(r.Status)}
}

var (
	podIndex = statedb.Index[*ReadyAnnotation, string]{
		Name:       "pod",
		FromObject: func(r *ReadyAnnotation) index.KeySet { return index.NewKeySet(index.String(r.Pod)) },
		FromKey:    index.String,
		FromString: index.FromString,
		Unique:     true,
	}
	// ByPod queries the row of a pod ("namespace/name").
	ByPod = podIndex.Query
)

// NewTable creates the ready-annotations table.
func NewTable(db *statedb.DB) (statedb.RWTable[*ReadyAnnotation], error) {
	return statedb.NewTable(db, TableName, podIndex)
}
