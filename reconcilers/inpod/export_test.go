// SPDX-License-Identifier: Apache-2.0

package inpod

import (
	"time"

	"github.com/cilium/statedb"

	"github.com/mtlsbridge/mtlsbridge/tables"
)

// NetlinkTargetForTests is the cell's target, for tests that read real pods'
// namespaces (not the node's).
func NetlinkTargetForTests() Target { return netlinkTarget{} }

// ProbeCheckInterval, provided, replaces how often the node's probe SNAT
// is read again.
type ProbeCheckInterval = probeCheckInterval

// PruneInterval is the reconciler's periodic prune interval.
const PruneInterval = pruneInterval

// TableReportsForTests keeps cni-pods rows in the table only (package
// cni, which keeps them on disk too, has tests of its own); the agent
// first started now.
func TableReportsForTests(db *statedb.DB, cniPods statedb.RWTable[*tables.CNIPod]) tables.CNIReports {
	return tableReportsOf{db, cniPods, time.Now()}
}
