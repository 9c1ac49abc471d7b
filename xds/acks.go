// SPDX-License-Identifier: Apache-2.0

package xds

import (
	"strconv"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"

	"github.com/mtlsbridge/mtlsbridge/reconcilers/workload"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// AcksTableName is the name of the table of acknowledged workloads.
const AcksTableName = "xds-acks"

// Ack is a workload of this node that a connected mTLS agent holds: one it
// acknowledged, or said it held at the current version when it
// reconnected. The bypass check reads it: a pod whose Workload the agent
// does not hold with HBONE is not reached through the tunnel. A stream's
// rows go with it.
type Ack struct {
	Stream uint64 `json:"stream"`
	// UID is the Workload's resource name.
	UID   string `json:"uid"`
	HBONE bool   `json:"hbone"`
}

func (a *Ack) key() index.Key {
	return index.String(strconv.FormatUint(a.Stream, 10) + "/" + a.UID)
}

func (a *Ack) Scope() tables.Scope {
	pod, _ := workload.PodOf(a.UID)
	return tables.PodScope(pod, "")
}

func (a *Ack) TableHeader() []string { return []string{"Stream", "UID", "HBONE"} }

func (a *Ack) TableRow() []string {
	return []string{strconv.FormatUint(a.Stream, 10), a.UID, strconv.FormatBool(a.HBONE)}
}

var (
	ackKeyIndex = statedb.Index[*Ack, string]{
		Name:       "key",
		FromObject: func(a *Ack) index.KeySet { return index.NewKeySet(a.key()) },
		FromKey:    index.String,
		FromString: index.FromString,
		Unique:     true,
	}
	ackUIDIndex = statedb.Index[*Ack, string]{
		Name:       "uid",
		FromObject: func(a *Ack) index.KeySet { return index.NewKeySet(index.String(a.UID + "|")) },
		FromKey:    func(uid string) index.Key { return index.String(uid + "|") },
		FromString: func(uid string) (index.Key, error) { return index.String(uid + "|"), nil },
	}
	ackStreamIndex = statedb.Index[*Ack, uint64]{
		Name:       "stream",
		FromObject: func(a *Ack) index.KeySet { return index.NewKeySet(index.Uint64(a.Stream)) },
		FromKey:    index.Uint64,
		FromString: index.Uint64String,
	}

	// AcksByUID queries the streams holding a workload.
	AcksByUID = ackUIDIndex.Query
	// AcksByStream queries what a stream holds.
	AcksByStream = ackStreamIndex.Query
)

// NewAcksTable creates the xds-acks table.
func NewAcksTable(db *statedb.DB) (statedb.RWTable[*Ack], error) {
	return statedb.NewTable(db, AcksTableName, ackKeyIndex, ackUIDIndex, ackStreamIndex)
}

// HoldsHBONE reports whether a connected mTLS agent holds the workload uid
// with HBONE as its tunnel protocol.
func HoldsHBONE(txn statedb.ReadTxn, acks statedb.Table[*Ack], uid string) bool {
	for a := range acks.List(txn, AcksByUID(uid)) {
		if a.HBONE {
			return true
		}
	}
	return false
}
