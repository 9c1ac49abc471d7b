// SPDX-License-Identifier: Apache-2.0

package tables

import (
	"strconv"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
)

// EndpointsTableName is the name of the table of CiliumEndpoints.
const EndpointsTableName = "endpoints"

// Endpoint is the part of a CiliumEndpoint mtlsbridge needs: the numeric
// Cilium security identity of the pod of the same namespace and name.
type Endpoint struct {
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	// Identity is the Cilium security identity; 0 while Cilium has not
	// allocated one yet.
	Identity uint32 `json:"identity,omitempty"`
}

// Key is the primary key, "namespace/name", equal to the pod's key.
func (e *Endpoint) Key() string { return e.Namespace + "/" + e.Name }

func (e *Endpoint) TableHeader() []string { return []string{"Name", "Identity"} }

func (e *Endpoint) TableRow() []string {
	id := "-"
	if e.Identity != 0 {
		id = strconv.FormatUint(uint64(e.Identity), 10)
	}
	return []string{e.Key(), id}
}

var (
	endpointKeyIndex = statedb.Index[*Endpoint, string]{
		Name:       "name",
		FromObject: func(e *Endpoint) index.KeySet { return index.NewKeySet(index.String(e.Key())) },
		FromKey:    index.String,
		FromString: index.FromString,
		Unique:     true,
	}

	// EndpointByKey queries the endpoint of the pod "namespace/name".
	EndpointByKey = endpointKeyIndex.Query
)

// NewEndpointsTable creates the endpoints table.
func NewEndpointsTable(db *statedb.DB) (statedb.RWTable[*Endpoint], error) {
	return statedb.NewTable(db, EndpointsTableName, endpointKeyIndex)
}
