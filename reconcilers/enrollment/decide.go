// SPDX-License-Identifier: Apache-2.0

package enrollment

import (
	"github.com/cilium/statedb"

	"github.com/mtlsbridge/mtlsbridge/tables"
)

// Decide applies the enrollment rules to a pod as the caller describes it,
// against the namespaces, policies and endpoints of txn. The CNI endpoint
// uses it at pod start, when the pod in the tables has no address yet (the
// kubelet writes status.podIPs after the CNI ADD returns) and the
// enrollments table therefore says excluded:no-ip.
func Decide(cfg Config, txn statedb.ReadTxn, namespaces statedb.Table[*tables.Namespace],
	policies statedb.Table[*tables.Policy], endpoints statedb.Table[*tables.Endpoint], pod *tables.Pod) *Enrollment {
	return decide(cfg, inputs{txn: txn, namespaces: namespaces, policies: policies, endpoints: endpoints}, pod)
}
