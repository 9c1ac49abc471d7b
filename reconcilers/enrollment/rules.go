// SPDX-License-Identifier: Apache-2.0

package enrollment

import (
	"strings"

	"github.com/cilium/statedb"

	"github.com/mtlsbridge/mtlsbridge/spiffe"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// Reasons shown in the enrollments table, by precedence.
const (
	ReasonHostNetwork       = reasonExcludedPrefix + "host-network"
	ReasonFinished          = reasonExcludedPrefix + "finished"
	ReasonNoIP              = reasonExcludedPrefix + "no-ip"
	ReasonMTLSAgent         = reasonExcludedPrefix + "mtls-agent"
	ReasonExcludedNamespace = reasonExcludedPrefix + "namespace"
	ReasonOptOut            = "opt-out-label"
	ReasonWorkloadLabel     = "label:" + tables.RedirTypeLabel + "=" + tables.RedirTypeWorkload
	ReasonPolicyPrefix      = "policy:"
	ReasonNamespaceLabel    = "namespace-label"
	ReasonNotSelected       = "not-selected"
)

const reasonExcludedPrefix = "excluded:"

// Excluded reports whether a rule that never enrolls decided: namespaces
// and policies did not count.
func (e *Enrollment) Excluded() bool { return strings.HasPrefix(e.Reason, reasonExcludedPrefix) }

// inputs are the rows a decision reads, all from one snapshot.
type inputs struct {
	txn        statedb.ReadTxn
	namespaces statedb.Table[*tables.Namespace]
	policies   statedb.Table[*tables.Policy]
	// anchors, when set, answers the anchor queries instead of policies.
	anchors *anchorIndex
	// key is the scratch buffer of anchor keys.
	key []byte
}

// decide applies the enrollment rules (README, "Enrollment rules") to one
// pod. The first rule that matches decides:
//  1. never: host network, finished, the mTLS agent, excluded namespace, no IP
//     (a pod the rules below would enroll awaits its address: AwaitingIP);
//  2. a CNP/CCNP requiring authentication (authentication.mode required, or
//     its annotation) that selects the pod (the policy with the smallest
//     key is named); the pod's opt-out label does not cancel it, and the
//     row says that it was ignored;
//  3. the pod label cilium.io/redir-type: "none" opts out, "workload" enrolls;
//  4. the namespace label io.cilium/mtls-enabled=true.
func decide(cfg Config, in *inputs, pod *tables.Pod) *Enrollment {
	redirType := pod.Labels.Get(tables.RedirTypeLabel)
	e := &Enrollment{
		Namespace: pod.Namespace,
		Pod:       pod.Name,
		UID:       pod.UID,
		Node:      pod.NodeName,
		MTLSAgent: cfg.MTLSAgent(pod),
	}
	e.IgnoredAgentLabel = redirType == tables.RedirTypeProxy && !e.MTLSAgent
	switch {
	case pod.HostNetwork:
		e.Reason = ReasonHostNetwork
	case pod.Finished():
		e.Reason = ReasonFinished
	case e.MTLSAgent:
		e.Reason = ReasonMTLSAgent
	case cfg.excluded(pod.Namespace):
		e.Reason = ReasonExcludedNamespace
	default:
		ns, _, _ := in.namespaces.Get(in.txn, tables.NamespaceByName(pod.Namespace))
		if p := selectingPolicy(in, pod, ns, cfg.ClusterName); p != "" {
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
	if len(pod.IPs) == 0 && !e.Excluded() {
		// Nothing to redirect yet. A scheduled pod's identities are its
		// own already: its node's mTLS agent asks for them as soon as the
		// CNI has given the pod an address, before the API shows that
		// address. A pod on no node yet holds none.
		e.AwaitingIP, e.Enrolled, e.Reason = e.Enrolled && pod.NodeName != "", false, ReasonNoIP
	}
	if e.Enrolled || e.AwaitingIP {
		e.SpiffeID = spiffe.WorkloadID(cfg.TrustDomain, pod.Namespace, pod.ServiceAccountOrDefault())
		// A reserved identity (init, while Cilium resolves the pod's
		// labels) is never a pod's to prove.
		if pod.Identity >= spiffe.MinimalPodIdentity {
			e.IdentitySpiffeID = spiffe.CiliumIdentityID(cfg.TrustDomain, pod.Identity)
		}
	}
	return e
}

// selectingPolicy returns the smallest key of the policies that require
// authentication and select the pod, or "". Candidates are the policies
// anchored on the pod's namespace, on one of its labels, or on any pod.
func selectingPolicy(in *inputs, pod *tables.Pod, ns *tables.Namespace, cluster string) string {
	best := ""
	consider := func(k, v string) {
		in.key = append(append(append(in.key[:0], k...), '='), v...)
		for _, p := range in.anchored(in.key) {
			if key := p.Key(); (best == "" || key < best) && p.Selects(pod, ns, cluster) {
				best = key
			}
		}
	}
	consider(tables.NamespaceLabel, pod.Namespace)
	in.key = append(in.key[:0], tables.MatchAll...)
	for _, p := range in.anchored(in.key) {
		if key := p.Key(); (best == "" || key < best) && p.Selects(pod, ns, cluster) {
			best = key
		}
	}
	for k, v := range pod.Labels.All() {
		consider(k, v)
	}
	return best
}

// anchored returns the policies anchored on key ("k=v" or MatchAll).
func (in *inputs) anchored(key []byte) []*tables.Policy {
	if in.anchors != nil {
		return in.anchors.policies[string(key)] // no allocation: a map lookup
	}
	return statedb.Collect(in.policies.List(in.txn, tables.PoliciesByAnchor(string(key))))
}

// anchorIndex is the policies table grouped by anchor, as of one revision
// of the table. A derivation visits every label of every pod: a lookup here
// costs a map access, where a table query costs an iterator and its
// allocations. Policies change seldom; it is rebuilt when they do.
type anchorIndex struct {
	revision statedb.Revision
	policies map[string][]*tables.Policy
}

func newAnchorIndex(txn statedb.ReadTxn, policies statedb.Table[*tables.Policy]) *anchorIndex {
	idx := &anchorIndex{revision: policies.Revision(txn), policies: map[string][]*tables.Policy{}}
	for p := range policies.All(txn) {
		for _, a := range p.Anchors() {
			idx.policies[a] = append(idx.policies[a], p)
		}
	}
	return idx
}
