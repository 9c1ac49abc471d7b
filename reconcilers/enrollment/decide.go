// SPDX-License-Identifier: Apache-2.0

package enrollment

import (
	"github.com/cilium/statedb"

	"github.com/mtlsbridge/mtlsbridge/tables"
)

// Decide applies the enrollment rules to a pod as the caller describes it,
// against the namespaces and policies of txn. The CNI route uses
// it at pod start with the addresses of the sandbox being added, before
// the enrollments table has seen them.
func Decide(cfg Config, txn statedb.ReadTxn, namespaces statedb.Table[*tables.Namespace],
	policies statedb.Table[*tables.Policy], pod *tables.Pod) *Enrollment {
	return decide(cfg, &inputs{txn: txn, namespaces: namespaces, policies: policies}, pod)
}
