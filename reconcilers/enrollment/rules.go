// SPDX-License-Identifier: Apache-2.0

package enrollment

import (
	"github.com/cilium/statedb"

	"github.com/mtlsbridge/mtlsbridge/spiffe"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// Reasons shown in the enrollments table, by precedence.
const (
	ReasonHostNetwork       = "excluded:host-network"
	ReasonFinished          = "excluded:finished"
	ReasonNoIP              = "excluded:no-ip"
	ReasonMTLSAgent         = "excluded:mtls-agent"
	ReasonExcludedNamespace = "excluded:namespace"
	ReasonOptOut            = "opt-out-label"
	ReasonWorkloadLabel     = "label:" + tables.RedirTypeLabel + "=" + tables.RedirTypeWorkload
	ReasonPolicyPrefix      = "policy:"
	ReasonNamespaceLabel    = "namespace-label"
	ReasonNotSelected       = "not-selected"
)

// inputs are the rows a decision reads, all from one snapshot.
type inputs struct {
	txn        statedb.ReadTxn
	namespaces statedb.Table[*tables.Namespace]
	policies   statedb.Table[*tables.Policy]
	endpoints  statedb.Table[*tables.Endpoint]
	// anchor is the scratch buffer of policy anchor queries.
	anchor []byte
}

// decide applies the enrollment rules (README, "Enrollment rules") to one
// pod. The first rule that matches decides:
//  1. never: host network, finished, the mTLS agent, excluded namespace, no IP;
//  2. a CNP/CCNP requiring authentication (authentication.mode required, or
//     its annotation) that selects the pod (the policy with the smallest
//     key is named); the pod's opt-out label does not cancel it, and the
//     row says that it was ignored;
//  3. the pod label cilium.io/redir-type: "none" opts out, "workload" enrolls;
//  4. the namespace label io.cilium/mtls-enabled=true.
func decide(cfg Config, in *inputs, pod *tables.Pod) *Enrollment {
	e := &Enrollment{
		Namespace: pod.Namespace,
		Pod:       pod.Name,
		UID:       pod.UID,
		Node:      pod.NodeName,
		MTLSAgent: pod.Labels.Get(tables.RedirTypeLabel) == tables.RedirTypeProxy,
	}
	redirType := pod.Labels.Get(tables.RedirTypeLabel)
	switch {
	case pod.HostNetwork:
		e.Reason = ReasonHostNetwork
	case pod.Finished():
		e.Reason = ReasonFinished
	case e.MTLSAgent:
		e.Reason = ReasonMTLSAgent
	case cfg.excluded(pod.Namespace):
		e.Reason = ReasonExcludedNamespace
	case len(pod.IPs) == 0:
		e.Reason = ReasonNoIP
	default:
		ns, _, _ := in.namespaces.Get(in.txn, tables.NamespaceByName(pod.Namespace))
		if p := selectingPolicy(in, pod, ns); p != "" {
			// A workload owner's label never cancels a policy owner's
			// requirement.
			e.Enrolled, e.Reason, e.Policy = true, ReasonPolicyPrefix+p, p
			e.IgnoredOptOut = redirType == tables.RedirTypeNone
		} else if redirType == tables.RedirTypeNone {
			e.Reason = ReasonOptOut
		} else if redirType == tables.RedirTypeWorkload {
			e.Enrolled, e.Reason = true, ReasonWorkloadLabel
		} else if ns != nil && ns.Labels.Get(tables.NamespaceEnabledLabel) == "true" {
			e.Enrolled, e.Reason = true, ReasonNamespaceLabel
		} else {
			e.Reason = ReasonNotSelected
		}
	}
	if e.Enrolled {
		e.SpiffeID = spiffe.WorkloadID(cfg.TrustDomain, pod.Namespace, pod.ServiceAccountOrDefault())
		if ep, _, found := in.endpoints.Get(in.txn, tables.EndpointByKey(pod.Key())); found && ep.Identity != 0 {
			e.IdentitySpiffeID = spiffe.CiliumIdentityID(cfg.TrustDomain, ep.Identity)
		}
	}
	return e
}

// selectingPolicy returns the smallest key of the policies that require
// authentication and select the pod, or "". Candidates come from the anchor
// index: policies of the pod's namespace, policies anchored on one of its
// labels, and policies that may select any pod.
func selectingPolicy(in *inputs, pod *tables.Pod, ns *tables.Namespace) string {
	best := ""
	consider := func(q statedb.Query[*tables.Policy]) {
		for p := range in.policies.List(in.txn, q) {
			if key := p.Key(); (best == "" || key < best) && p.Selects(pod, ns) {
				best = key
			}
		}
	}
	var q statedb.Query[*tables.Policy]
	q, in.anchor = tables.PoliciesByLabel(in.anchor, tables.NamespaceLabel, pod.Namespace)
	consider(q)
	consider(tables.PoliciesByAnchor(tables.MatchAll))
	for k, v := range pod.Labels.All() {
		q, in.anchor = tables.PoliciesByLabel(in.anchor, k, v)
		consider(q)
	}
	return best
}
