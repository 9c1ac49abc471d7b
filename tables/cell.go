// SPDX-License-Identifier: Apache-2.0

// Package tables defines the statedb tables that hold what mtlsbridge knows
// of the cluster: pods, namespaces, Cilium policies and endpoints, nodes, and
// the sources they came from. The sources (package tables/ingest) are their
// only writers; everything else reads them. One more input comes from the
// node itself: cni-pods, what the CNI plugin reported at pod start, written
// by package cni.
package tables

import (
	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
)

// Cell provides the identity of the local node and the cni-pods table.
var Cell = cell.Module(
	"tables",
	"Cluster state shared by every component",

	// The node name decides which pods are local; every component needs it.
	cell.Config(DefaultLocalNode()),
	// Empty and initialized when package cni is not in the hive.
	cell.Provide(NewCNIPodsTable, statedb.RWTable[*CNIPod].ToTable),
)
