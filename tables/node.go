// SPDX-License-Identifier: Apache-2.0

package tables

import (
	"net/netip"
	"strings"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
)

// NodesTableName is the name of the table of Kubernetes nodes.
const NodesTableName = "nodes"

// Node is a Kubernetes node: its name, labels and internal addresses.
type Node struct {
	Name      string       `json:"name"`
	Labels    Labels       `json:"labels,omitzero"`
	Addresses []netip.Addr `json:"addresses,omitempty"`
}

func (n *Node) TableHeader() []string { return []string{"Name", "Addresses", "Labels"} }

func (n *Node) TableRow() []string {
	addrs := make([]string, len(n.Addresses))
	for i, a := range n.Addresses {
		addrs[i] = a.String()
	}
	return []string{n.Name, Dash(strings.Join(addrs, ",")), Dash(n.Labels.String())}
}

var (
	nodeNameIndex = statedb.Index[*Node, string]{
		Name:       "name",
		FromObject: func(n *Node) index.KeySet { return index.NewKeySet(index.String(n.Name)) },
		FromKey:    index.String,
		FromString: index.FromString,
		Unique:     true,
	}

	// NodeByName queries a node by its name.
	NodeByName = nodeNameIndex.Query
)

// NewNodesTable creates the nodes table.
func NewNodesTable(db *statedb.DB) (statedb.RWTable[*Node], error) {
	return statedb.NewTable(db, NodesTableName, nodeNameIndex)
}
