// SPDX-License-Identifier: Apache-2.0

package tables

import (
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
)

// NamespacesTableName is the name of the table of namespaces.
const NamespacesTableName = "namespaces"

// Namespace is a Kubernetes namespace and its labels.
type Namespace struct {
	Name   string `json:"name"`
	Labels Labels `json:"labels,omitzero"`
	// SourceIPDelegated: the namespace lets its pods turn off Cilium's
	// source IP verification (DelegateSourceIPVerificationAnnotation).
	SourceIPDelegated bool `json:"sourceIPDelegated,omitempty"`
}

// NewNamespace keeps what mtlsbridge uses of a namespace.
func NewNamespace(name string, labels, annotations map[string]string) *Namespace {
	return &Namespace{Name: name, Labels: NewLabels(labels),
		SourceIPDelegated: AnnotationTrue(annotations, DelegateSourceIPVerificationAnnotation)}
}

func (n *Namespace) TableHeader() []string { return []string{"Name", "Labels"} }
func (n *Namespace) TableRow() []string    { return []string{n.Name, Dash(n.Labels.String())} }

var (
	namespaceNameIndex = statedb.Index[*Namespace, string]{
		Name:       "name",
		FromObject: func(n *Namespace) index.KeySet { return index.NewKeySet(index.String(n.Name)) },
		FromKey:    index.String,
		FromString: index.FromString,
		Unique:     true,
	}

	// NamespaceByName queries a namespace by its name.
	NamespaceByName = namespaceNameIndex.Query
)

// NewNamespacesTable creates the namespaces table.
func NewNamespacesTable(db *statedb.DB) (statedb.RWTable[*Namespace], error) {
	return statedb.NewTable(db, NamespacesTableName, namespaceNameIndex)
}
