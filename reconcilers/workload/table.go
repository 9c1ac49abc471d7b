// SPDX-License-Identifier: Apache-2.0

package workload

import (
	"encoding/json"
	"net/netip"
	"strconv"
	"strings"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"istio.io/istio/pkg/workloadapi"

	"github.com/mtlsbridge/mtlsbridge/tables"
)

// TableName is the name of the workloads table.
const TableName = "workloads"

// Workload is what the mTLS agent is told about one enrolled pod: the
// xDS resource, already encoded, under its resource name. Kept lean (what
// the resource says is decoded for display only): it exists for every
// enrolled pod of the cluster.
type Workload struct {
	// Resource is the encoded istio.workload.Address: a string, as it
	// never changes, so that the uid is read from it in place.
	Resource string
	// Version is a hash of Resource: equal content, equal version, across
	// restarts too (clients compare it in initial_resource_versions).
	Version uint64
	// uidAt and uidLen locate the uid field inside Resource, so that the
	// row holds no string of its own: 16 B fewer for every enrolled pod of
	// the cluster.
	uidAt, uidLen uint16
	// HBONE is true when the pod's redirection is in place, so peers may
	// tunnel to it; otherwise the agent is told NONE.
	HBONE bool
}

// UID is the resource name: CLUSTER_ID//Pod/NAMESPACE/NAME (see the
// function UID), the uid field inside Resource.
func (w *Workload) UID() string {
	return w.Resource[w.uidAt : int(w.uidAt)+int(w.uidLen)]
}

// Decode returns the Workload the resource holds (for display: the table
// keeps it encoded).
func (w *Workload) Decode() *workloadapi.Workload {
	var addr workloadapi.Address
	proto.Unmarshal([]byte(w.Resource), &addr)
	return addr.GetWorkload()
}

func (w *Workload) Scope() tables.Scope {
	pod, _ := PodOf(w.UID())
	return tables.PodScope(pod, w.Decode().GetNode())
}

// MarshalJSON shows what the mTLS agent is told: the Workload itself
// (protojson, as in Istio's dumps), and the version as a string (a 64-bit
// number loses digits in JSON tools).
func (w *Workload) MarshalJSON() ([]byte, error) {
	wl := w.Decode()
	b, err := protojson.Marshal(wl)
	if err != nil {
		return nil, err
	}
	// Addresses as IPs, not base64 of their bytes (istioctl shows them so).
	var decoded map[string]any
	if err := json.Unmarshal(b, &decoded); err != nil {
		return nil, err
	}
	if len(wl.GetAddresses()) > 0 {
		addrs := make([]string, len(wl.GetAddresses()))
		for i, a := range wl.GetAddresses() {
			ip, _ := netip.AddrFromSlice(a)
			addrs[i] = ip.String()
		}
		decoded["addresses"] = addrs
	}
	return json.Marshal(struct {
		UID      string         `json:"uid"`
		HBONE    bool           `json:"hbone"`
		Version  string         `json:"version"`
		Workload map[string]any `json:"workload"`
	}{w.UID(), w.HBONE, w.VersionString(), decoded})
}

// VersionString is the version as sent in xDS.
func (w *Workload) VersionString() string { return strconv.FormatUint(w.Version, 16) }

func (w *Workload) TableHeader() []string {
	return []string{"UID", "Node", "Addresses", "Protocol", "Version", "Bytes"}
}

func (w *Workload) TableRow() []string {
	wl := w.Decode()
	addrs := make([]string, len(wl.GetAddresses()))
	for i, a := range wl.GetAddresses() {
		ip, _ := netip.AddrFromSlice(a)
		addrs[i] = ip.String()
	}
	protocol := "NONE"
	if w.HBONE {
		protocol = "HBONE"
	}
	return []string{w.UID(), wl.GetNode(), strings.Join(addrs, ","), protocol, w.VersionString(), strconv.Itoa(len(w.Resource))}
}

// UID is the resource name of a pod's workload. It follows Istio's scheme
// (cluster/group/kind/namespace/name) so that names read the same in
// ztunnel's dumps; it is stable while the pod keeps its name.
func UID(clusterID, namespace, name string) string {
	return clusterID + podInfix + namespace + "/" + name
}

const podInfix = "//Pod/"

// PodOf returns the pod ("namespace/name") whose workload uid names.
func PodOf(uid string) (pod string, ok bool) {
	_, pod, ok = strings.Cut(uid, podInfix)
	return pod, ok
}

var (
	uidIndex = statedb.Index[*Workload, string]{
		Name:       "uid",
		FromObject: func(w *Workload) index.KeySet { return index.NewKeySet(index.String(w.UID())) },
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
