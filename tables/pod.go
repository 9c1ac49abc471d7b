// SPDX-License-Identifier: Apache-2.0

package tables

import (
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
	Namespace      string       `json:"namespace"`
	Name           string       `json:"name"`
	UID            string       `json:"uid"`
	NodeName       string       `json:"nodeName,omitempty"`
	ServiceAccount string       `json:"serviceAccount,omitempty"`
	Labels         Labels       `json:"labels,omitempty"`
	HostNetwork    bool         `json:"hostNetwork,omitempty"`
	Phase          string       `json:"phase,omitempty"`
	IPs            []netip.Addr `json:"ips,omitempty"`
	// RedirectReady is the node agent's published word that the pod's
	// redirection is in place (annotation mtlsbridge.io/redirect: ready).
	RedirectReady bool `json:"redirectReady,omitempty"`
}

// RedirectAnnotation is published on pods whose redirection is in place,
// with the value RedirectReadyValue, so that every node can tell.
const (
	RedirectAnnotation = "mtlsbridge.io/redirect"
	RedirectReadyValue = "ready"
)

// Key is the primary key: "namespace/name".
func (p *Pod) Key() string { return p.Namespace + "/" + p.Name }

// Finished reports whether the pod has terminated for good.
func (p *Pod) Finished() bool { return p.Phase == "Succeeded" || p.Phase == "Failed" }

// ServiceAccountOrDefault is the service account Kubernetes applies when none is set.
func (p *Pod) ServiceAccountOrDefault() string {
	if p.ServiceAccount == "" {
		return "default"
	}
	return p.ServiceAccount
}

func (p *Pod) TableHeader() []string {
	return []string{"Name", "Node", "ServiceAccount", "IPs", "Phase", "HostNetwork", "Labels"}
}

func (p *Pod) TableRow() []string {
	ips := make([]string, len(p.IPs))
	for i, ip := range p.IPs {
		ips[i] = ip.String()
	}
	return []string{
		p.Key(), Dash(p.NodeName), p.ServiceAccountOrDefault(), Dash(strings.Join(ips, ",")),
		Dash(p.Phase), strconv.FormatBool(p.HostNetwork), Dash(p.Labels.String()),
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
	podNamespaceIndex = statedb.Index[*Pod, string]{
		Name:       "namespace",
		FromObject: func(p *Pod) index.KeySet { return index.NewKeySet(ExactKey(p.Namespace)) },
		FromKey:    ExactKey,
		FromString: ExactKeyFromString,
	}
	podNodeIndex = statedb.Index[*Pod, string]{
		Name:       "node",
		FromObject: func(p *Pod) index.KeySet { return index.NewKeySet(ExactKey(p.NodeName)) },
		FromKey:    ExactKey,
		FromString: ExactKeyFromString,
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
	// PodsByNamespace queries the pods of a namespace.
	PodsByNamespace = podNamespaceIndex.Query
	// PodsByNode queries the pods scheduled to a node.
	PodsByNode = podNodeIndex.Query
	// PodsByIP queries the pods holding an address.
	PodsByIP = podIPIndex.Query
)

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

// NewPodsTable creates the pods table.
func NewPodsTable(db *statedb.DB) (statedb.RWTable[*Pod], error) {
	return statedb.NewTable(db, PodsTableName, podKeyIndex, podNamespaceIndex, podNodeIndex, podIPIndex)
}
