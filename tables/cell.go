// SPDX-License-Identifier: Apache-2.0

// Package tables defines the statedb tables that hold what mtlsbridge knows
// of the cluster: pods, namespaces, Cilium policies and endpoints, nodes, and
// the sources they came from. The sources (package tables/source) are their
// only writers; everything else reads them.
package tables

import "github.com/cilium/hive/cell"

// Cell provides the identity of the local node.
var Cell = cell.Module(
	"tables",
	"Cluster state shared by every component",

	// The node name decides which pods are local; every component needs it.
	cell.Config(DefaultLocalNode()),
)
