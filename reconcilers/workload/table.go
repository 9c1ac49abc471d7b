// SPDX-License-Identifier: Apache-2.0

package workload

import (
	"net/netip"
	"strconv"
	"strings"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
)

// TableName is the name of the workloads table.
const TableName = "workloads"

// Workload is what the mTLS agent is told about one enrolled pod: the
// xDS resource, already encoded, under its resource name.
type Workload struct {
	// UID is the resource name: CLUSTER_ID//Pod/NAMESPACE/NAME (see UID).
	UID string `json:"uid"`
	// Pod is "namespace/name".
	Pod       string       `json:"pod"`
	Node      string       `json:"node"`
	Addresses []netip.Addr `json:"addresses"`
	// HBONE is true when the pod's redirection is in place, so peers may
	// tunnel to it; otherwise the agent is told NONE.
	HBONE bool `json:"hbone"`
	// Version is a hash of Resource: equal content, equal version, across
	// restarts too (clients compare it in initial_resource_versions).
	Version uint64 `json:"version"`
	// Resource is the encoded istio.workload.Address.
	Resource []byte `json:"-"`
}

// VersionString is the version as sent in xDS.
func (w *Workload) VersionString() string { return strconv.FormatUint(w.Version, 16) }

func (w *Workload) TableHeader() []string {
	return []string{"UID", "Node", "Addresses", "Protocol", "Version", "Bytes"}
}

func (w *Workload) TableRow() []string {
	addrs := make([]string, len(w.Addresses))
	for i, a := range w.Addresses {
		addrs[i] = a.String()
	}
	proto := "NONE"
	if w.HBONE {
		proto = "HBONE"
	}
	return []string{w.UID, w.Node, strings.Join(addrs, ","), proto, w.VersionString(), strconv.Itoa(len(w.Resource))}
}

// UID is the resource name of a pod's workload. It follows Istio's scheme
// (cluster/group/kind/namespace/name) so that names read the same in
// ztunnel's dumps; it is stable while the pod keeps its name.
func UID(clusterID, namespace, name string) string {
	return clusterID + "//Pod/" + namespace + "/" + name
}

// AddressName is the on-demand name of an address: "network/ip".
func AddressName(network string, ip netip.Addr) string { return network + "/" + ip.String() }

var (
	uidIndex = statedb.Index[*Workload, string]{
		Name:       "uid",
		FromObject: func(w *Workload) index.KeySet { return index.NewKeySet(index.String(w.UID)) },
		FromKey:    index.String,
		FromString: index.FromString,
		Unique:     true,
	}
	addressIndex = statedb.Index[*Workload, netip.Addr]{
		Name: "address",
		FromObject: func(w *Workload) index.KeySet {
			if len(w.Addresses) == 0 {
				return index.KeySet{}
			}
			keys := make([]index.Key, len(w.Addresses))
			for i, a := range w.Addresses {
				keys[i] = index.NetIPAddr(a)
			}
			return index.NewKeySet(keys[0], keys[1:]...)
		},
		FromKey:    index.NetIPAddr,
		FromString: index.NetIPAddrString,
	}

	// ByUID queries a workload by its resource name.
	ByUID = uidIndex.Query
	// ByAddress queries the workloads holding an IP.
	ByAddress = addressIndex.Query
)

// NewTable creates the workloads table.
func NewTable(db *statedb.DB) (statedb.RWTable[*Workload], error) {
	return statedb.NewTable(db, TableName, uidIndex, addressIndex)
}
