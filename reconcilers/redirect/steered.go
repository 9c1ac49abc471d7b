// SPDX-License-Identifier: Apache-2.0

package redirect

import (
	"iter"
	"net/netip"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/mtlsbridge/mtlsbridge/bpf"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/steering"
)

// Steering says whether the datapath steers a pod's TCP to the mTLS agent,
// by the reconcile status of the rows that do it.
type Steering = steering.Steering

const (
	// Steered: the agent's entry, an enrolled entry of the pod for each of
	// its addresses and the from-pod program on its interface are all in
	// the kernel.
	Steered = steering.Steered
	// Settling: some of those rows are still pending; the outcome is not
	// known yet.
	Settling = steering.Settling
	// NotSteered: a row failed or is missing (the pod is not enrolled, or
	// its redirection cannot be written).
	NotSteered = steering.NotSteered
)

// SteeringOf tells whether the datapath steers the pod ("namespace/name")
// for addrs. Readiness asks it for a pod's current addresses, the CNI
// route for those of the sandbox being added.
func SteeringOf(txn statedb.ReadTxn, redirects statedb.Table[*Redirect], attachments statedb.Table[*Attachment],
	pod string, addrs []netip.Addr) Steering {
	agent := rowsSteering(redirects.List(txn, RedirectByAddr(bpf.AgentKey)), bpf.KindAgent)
	return agent.And(podSteering(txn, redirects, attachments, pod, addrs))
}

// rowsSteering folds the statuses of rows that must all be done, and of
// kind kind for redirects.
func rowsSteering[T interface{ *Redirect | *Attachment }](rows iter.Seq2[T, statedb.Revision], kind bpf.Kind) Steering {
	state, seen := Steered, false
	for row := range rows {
		seen = true
		var status reconciler.Status
		switch r := any(row).(type) {
		case *Redirect:
			if r.Kind != kind {
				return NotSteered
			}
			status = r.Status
		case *Attachment:
			status = r.Status
		}
		switch status.Kind {
		case reconciler.StatusKindDone:
		case reconciler.StatusKindError:
			return NotSteered
		default:
			state = Settling
		}
	}
	if !seen {
		return NotSteered
	}
	return state
}

// podSteering: every address of the pod has a done enrolled entry of the
// pod, and the pod's interface has the from-pod program.
func podSteering(txn statedb.ReadTxn, redirects statedb.Table[*Redirect], attachments statedb.Table[*Attachment],
	pod string, addrs []netip.Addr) Steering {
	if len(addrs) == 0 {
		return NotSteered
	}
	state := rowsSteering(attachments.List(txn, AttachmentsByPod(pod)), 0)
	for _, ip := range addrs {
		row, _, ok := redirects.Get(txn, RedirectByAddr(ip))
		if !ok || row.Pod != pod {
			return NotSteered
		}
		state = state.And(rowsSteering(func(yield func(*Redirect, statedb.Revision) bool) { yield(row, 0) }, bpf.KindEnrolled))
	}
	return state
}
