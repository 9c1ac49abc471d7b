// SPDX-License-Identifier: Apache-2.0

package workload

import (
	"net/netip"
	"strconv"
	"strings"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
	"google.golang.org/protobuf/proto"
	"istio.io/istio/pkg/workloadapi"
)

// TableName is the name of the workloads table.
const TableName = "workloads"

// Workload is what the mTLS agent is told about one enrolled pod: the
// xDS resource, already encoded, under its resource name. Kept lean (what
// the resource says is decoded for display only): it exists for every
// enrolled pod of the cluster.
type Workload struct {
	// UID is the resource name: CLUSTER_ID//Pod/NAMESPACE/NAME (see UID).
	// It is the uid field inside Resource, not a copy of it.
	UID string `json:"uid"`
	// HBONE is true when the pod's redirection is in place, so peers may
	// tunnel to it; otherwise the agent is told NONE.
	HBONE bool `json:"hbone"`
	// Version is a hash of Resource: equal content, equal version, across
	// restarts too (clients compare it in initial_resource_versions).
	Version uint64 `json:"version"`
	// Resource is the encoded istio.workload.Address: a string, as it
	// never changes, so that UID can be a part of it (one allocation
	// fewer for every enrolled pod of the cluster).
	Resource string `json:"-"`
}

// VersionString is the version as sent in xDS.
func (w *Workload) VersionString() string { return strconv.FormatUint(w.Version, 16) }

func (w *Workload) TableHeader() []string {
	return []string{"UID", "Node", "Addresses", "Protocol", "Version", "Bytes"}
}

func (w *Workload) TableRow() []string {
	var addr workloadapi.Address
	proto.Unmarshal([]byte(w.Resource), &addr)
	wl := addr.GetWorkload()
	addrs := make([]string, len(wl.GetAddresses()))
	for i, a := range wl.GetAddresses() {
		ip, _ := netip.AddrFromSlice(a)
		addrs[i] = ip.String()
	}
	protocol := "NONE"
	if w.HBONE {
		protocol = "HBONE"
	}
	return []string{w.UID, wl.GetNode(), strings.Join(addrs, ","), protocol, w.VersionString(), strconv.Itoa(len(w.Resource))}
}

// UID is the resource name of a pod's workload. It follows Istio's scheme
// (cluster/group/kind/namespace/name) so that names read the same in
// ztunnel's dumps; it is stable while the pod keeps its name.
func UID(clusterID, namespace, name string) string {
	return clusterID + "//Pod/" + namespace + "/" + name
}

var (
	uidIndex = statedb.Index[*Workload, string]{
		Name:       "uid",
		FromObject: func(w *Workload) index.KeySet { return index.NewKeySet(index.String(w.UID)) },
		FromKey:    index.String,
		FromString: index.FromString,
		Unique:     true,
	}
	// ByUID queries a workload by its resource name.
	ByUID = uidIndex.Query
)

// NewTable creates the workloads table.
func NewTable(db *statedb.DB) (statedb.RWTable[*Workload], error) {
	return statedb.NewTable(db, TableName, uidIndex)
}
