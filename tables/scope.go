// SPDX-License-Identifier: Apache-2.0

package tables

import (
	"strings"
	"time"

	"github.com/cilium/statedb/reconciler"
)

// Scope is where a row of a table belongs, for `mtlsbridge db show
// --namespace/--pod/--node`: each field is empty when the row has none.
type Scope struct {
	Namespace string
	// Pod is "namespace/name".
	Pod  string
	Node string
}

// Scoped is a row that knows its Scope. Rows of tables without one (the
// sources) match no filter.
type Scoped interface {
	Scope() Scope
}

// PodScope is the scope of a row about the pod "namespace/name".
func PodScope(pod, node string) Scope {
	ns, _, _ := strings.Cut(pod, "/")
	return Scope{Namespace: ns, Pod: pod, Node: node}
}

func (p *Pod) Scope() Scope       { return PodScope(p.Key(), p.NodeName) }
func (n *Namespace) Scope() Scope { return Scope{Namespace: n.Name} }
func (p *Policy) Scope() Scope    { return Scope{Namespace: p.Namespace} }
func (n *Node) Scope() Scope      { return Scope{Node: n.Name} }
func (p *CNIPod) Scope() Scope    { return PodScope(p.Pod, "") }

// StatusJSON is a reconcile status as every table shows it in JSON: the
// kind, the error and when it was last written, in one case of names.
type StatusJSON struct {
	Kind      string    `json:"kind"`
	Error     string    `json:"error,omitempty"`
	UpdatedAt time.Time `json:"updatedAt"`
}

// NewStatusJSON converts a reconcile status.
func NewStatusJSON(s reconciler.Status) StatusJSON {
	return StatusJSON{Kind: s.Kind.String(), Error: s.GetError(), UpdatedAt: s.UpdatedAt}
}
