// SPDX-License-Identifier: Apache-2.0

package tables

import (
	"iter"
	"net/netip"
	"strconv"
	"strings"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
)

// PodsTableName is the name of the table of pods (all nodes).
const PodsTableName = "pods"

// NamespaceLabel is the pseudo label Cilium selectors use for a pod's
// namespace.
const NamespaceLabel = "io.kubernetes.pod.namespace"

// Pod is the part of a Kubernetes Pod that mtlsbridge needs.
type Pod struct {
	Namespace      string `json:"namespace"`
	Name           string `json:"name"`
	UID            string `json:"uid"`
	NodeName       string `json:"nodeName,omitempty"`
	ServiceAccount string `json:"serviceAccount,omitempty"`
	Labels         Labels `json:"labels,omitzero"`
	HostNetwork    bool   `json:"hostNetwork,omitempty"`
	// RedirectReady is the node agent's published word that the pod's
	// redirection is in place (annotation mtlsbridge.io/redirect: ready).
	// Next to the other bool, and Identity next to both: the row fits a
	// smaller size class (144 B, not 160).
	RedirectReady bool `json:"redirectReady,omitempty"`
	// SourceIPUnverified: the pod asks Cilium not to check the source of
	// what it sends (annotation DisableSourceIPVerification true), which
	// Cilium grants where the pod's namespace delegates it.
	SourceIPUnverified bool `json:"sourceIPUnverified,omitempty"`
	// Identity is the numeric Cilium security identity, from the pod's
	// CiliumEndpoint; 0 while Cilium has not allocated one (or the
	// endpoint is not seen yet). A column of the pod's row rather than a
	// table of its own: a row and its index entries cost about 230 B a
	// pod at 100,000 pods.
	Identity uint32       `json:"identity,omitempty"`
	Phase    string       `json:"phase,omitempty"`
	IPs      []netip.Addr `json:"ips,omitempty"`
}

// RedirectAnnotation is published on pods whose redirection is in place,
// with the value RedirectReadyValue, so that every node can tell.
const (
	RedirectAnnotation = "mtlsbridge.io/redirect"
	RedirectReadyValue = "ready"
)

// Cilium's annotations of source IP verification (v1.20): a namespace
// delegates the choice to its pods, and a pod so allowed may turn off the
// check that what it sends carries its own address. True is what
// strconv.ParseBool takes for true, spaces trimmed, as Cilium reads them.
const (
	DelegateSourceIPVerificationAnnotation = "config.cilium.io/delegate-source-ip-verification"
	DisableSourceIPVerificationAnnotation  = "config.cilium.io/disable-source-ip-verification"
)

// AnnotationTrue reads a boolean annotation as Cilium does.
func AnnotationTrue(annotations map[string]string, key string) bool {
	b, err := strconv.ParseBool(strings.TrimSpace(annotations[key]))
	return err == nil && b
}

// Key is the primary key: "namespace/name".
func (p *Pod) Key() string { return p.Namespace + "/" + p.Name }

// Finished reports whether the pod has terminated for good.
func (p *Pod) Finished() bool { return p.Phase == "Succeeded" || p.Phase == "Failed" }

// MatchesUID reports whether uid may be this pod's: equal, or unknown on
// either side. A pod created since under the same name has another UID.
func (p *Pod) MatchesUID(uid string) bool { return uid == "" || p.UID == "" || uid == p.UID }

// DefaultServiceAccount is the service account Kubernetes applies when none is set.
const DefaultServiceAccount = "default"

// ServiceAccountOrDefault is the pod's service account, or the default.
func (p *Pod) ServiceAccountOrDefault() string {
	if p.ServiceAccount == "" {
		return DefaultServiceAccount
	}
	return p.ServiceAccount
}

func (p *Pod) TableHeader() []string {
	return []string{"Name", "Node", "ServiceAccount", "IPs", "Phase", "HostNetwork", "Identity", "Labels"}
}

func (p *Pod) TableRow() []string {
	ips := make([]string, len(p.IPs))
	for i, ip := range p.IPs {
		ips[i] = ip.String()
	}
	return []string{
		p.Key(), Dash(p.NodeName), p.ServiceAccountOrDefault(), Dash(strings.Join(ips, ",")),
		Dash(p.Phase), strconv.FormatBool(p.HostNetwork), identityString(p.Identity), Dash(p.Labels.String()),
	}
}

var (
	podKeyIndex = statedb.Index[*Pod, string]{
		Name:       "name",
		FromObject: func(p *Pod) index.KeySet { return index.NewKeySet(index.String(p.Key())) },
		FromKey:    index.String,
		FromString: index.FromString,
		Unique:     true,
	}
	// podIPIndex finds pods by address (the bypass check, on-demand xDS).
	// Not unique: a finished pod may still hold an address reused since.
	podIPIndex = statedb.Index[*Pod, netip.Addr]{
		Name:       "ip",
		FromObject: func(p *Pod) index.KeySet { return addrKeys(p.IPs) },
		FromKey:    index.NetIPAddr,
		FromString: index.NetIPAddrString,
	}

	// PodByKey queries a pod by "namespace/name".
	PodByKey = podKeyIndex.Query
	// PodsByIP queries the pods holding an address.
	PodsByIP = podIPIndex.Query
)

// podLocalIndex holds the pods scheduled to node, and no other: the agent
// looks up as a set only the pods of its own node (its redirections, their
// readiness), and an index of every pod by node would cost 100 B a pod.
func podLocalIndex(node string) statedb.Index[*Pod, bool] {
	return statedb.Index[*Pod, bool]{
		Name: "local",
		FromObject: func(p *Pod) index.KeySet {
			if node == "" || p.NodeName != node {
				return index.KeySet{}
			}
			return index.NewKeySet(index.Bool(true))
		},
		FromKey:    index.Bool,
		FromString: index.BoolString,
	}
}

// PodsOfThisNode queries the pods scheduled to the agent's node.
func PodsOfThisNode() statedb.Query[*Pod] { return podLocalIndex("").Query(true) }

// PodsOfNamespace yields the pods of namespace ns: a prefix of their
// primary keys, which costs no index of its own (100 B a pod at 100,000).
func PodsOfNamespace(txn statedb.ReadTxn, pods statedb.Table[*Pod], ns string) iter.Seq2[*Pod, statedb.Revision] {
	return pods.Prefix(txn, PodByKey(ns+"/"))
}

// addrKeys are the keys of an address index.
func addrKeys(ips []netip.Addr) index.KeySet {
	if len(ips) == 0 {
		return index.KeySet{}
	}
	keys := make([]index.Key, len(ips))
	for i, ip := range ips {
		keys[i] = index.NetIPAddr(ip)
	}
	return index.NewKeySet(keys[0], keys[1:]...)
}

// NewPodsTable creates the pods table of the agent of node.
func NewPodsTable(db *statedb.DB, node LocalNode) (statedb.RWTable[*Pod], error) {
	return statedb.NewTable(db, PodsTableName, podKeyIndex, podLocalIndex(node.NodeName), podIPIndex)
}

// identityString shows a Cilium identity in a table, "-" for none.
func identityString(id uint32) string {
	if id == 0 {
		return "-"
	}
	return strconv.FormatUint(uint64(id), 10)
}
