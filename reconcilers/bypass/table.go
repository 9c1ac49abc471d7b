// SPDX-License-Identifier: Apache-2.0

package bypass

import (
	"strconv"
	"strings"
	"time"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"

	"github.com/mtlsbridge/mtlsbridge/tables"
)

// TableName is the name of the bypass table.
const TableName = "bypass"

// Bypass is the outcome of the last check of one enrolled pod of this node.
type Bypass struct {
	// Pod is "namespace/name".
	Pod string `json:"pod"`
	// Bypassing is true when at least one gap was found: some of the pod's
	// TCP may leave it without passing through the mTLS agent.
	Bypassing bool `json:"bypassing"`
	// Gaps are the reasons, one per gap found, in a stable order.
	Gaps      []string  `json:"gaps,omitempty"`
	CheckedAt time.Time `json:"checkedAt"`
}

func (b *Bypass) Scope() tables.Scope { return tables.PodScope(b.Pod, "") }

func (b *Bypass) TableHeader() []string {
	return []string{"Pod", "Bypassing", "Gaps", "CheckedAt"}
}

func (b *Bypass) TableRow() []string {
	gaps := "-"
	if len(b.Gaps) > 0 {
		gaps = strings.Join(b.Gaps, "; ")
	}
	return []string{b.Pod, strconv.FormatBool(b.Bypassing), gaps, b.CheckedAt.UTC().Format(time.RFC3339)}
}

var (
	podIndex = statedb.Index[*Bypass, string]{
		Name:       "pod",
		FromObject: func(b *Bypass) index.KeySet { return index.NewKeySet(index.String(b.Pod)) },
		FromKey:    index.String,
		FromString: index.FromString,
		Unique:     true,
	}
	bypassingIndex = statedb.Index[*Bypass, bool]{
		Name:       "bypassing",
		FromObject: func(b *Bypass) index.KeySet { return index.NewKeySet(index.Bool(b.Bypassing)) },
		FromKey:    index.Bool,
		FromString: index.BoolString,
	}

	// ByPod queries the row of a pod ("namespace/name").
	ByPod = podIndex.Query
	// ByBypassing queries the pods that bypass (true) or not (false).
	ByBypassing = bypassingIndex.Query
)

// NewTable creates the bypass table.
func NewTable(db *statedb.DB) (statedb.RWTable[*Bypass], error) {
	return statedb.NewTable(db, TableName, podIndex, bypassingIndex)
}
