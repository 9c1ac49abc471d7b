// SPDX-License-Identifier: Apache-2.0

package nodeagent

import (
	"strconv"
	"time"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
)

// Table names.
const (
	WorkloadsTableName   = "zds"
	ConnectionsTableName = "zds-connections"
)

// States of a pod's row: where its add stands with the newest ztunnel.
const (
	// StatePending: not sent yet (no ztunnel connected, or it reconnected
	// and the snapshot has not reached the pod).
	StatePending = "pending"
	// StateAcked: the newest ztunnel acknowledged the add of the pod in
	// its namespace.
	StateAcked = "acked"
	// StateNacked: ztunnel refused the add (Error); it is sent again with
	// backoff.
	StateNacked = "nacked"
	// StateKept: the namespace could not be opened at a snapshot (Error),
	// or is not known (the row's Problem): keep was sent, so that ztunnel
	// keeps what it has of the pod.
	StateKept = "kept"
	// StateFailed: the add cannot be sent (Error): the namespace cannot be
	// opened, or the message would be too large. Retried with backoff.
	StateFailed = "failed"
)

// Workload is one pod of this node to hand to ztunnel. The in-pod
// derivation writes the pod's part (Pod to Problem) and resets State to
// pending when it changes; the server writes State, Conn and Error.
type Workload struct {
	// Pod is "namespace/name".
	Pod string `json:"pod"`
	// UID is the pod's metadata.uid: ZDS's uid of the pod.
	UID string `json:"uid"`
	// Name, Namespace and ServiceAccount are the workload_info, exactly
	// as the Workload told over xDS carries them (ztunnel waits for a
	// Workload that matches).
	Name           string `json:"name"`
	Namespace      string `json:"namespace"`
	ServiceAccount string `json:"serviceAccount"`
	// Netns is the path of the pod's network namespace (from its CNI
	// report).
	Netns string `json:"netns"`
	// Problem says why the pod cannot be sent at all (no uid, no
	// namespace known).
	Problem string `json:"problem,omitempty"`

	State string `json:"state"`
	// Conn is the connection State is about (0: none).
	Conn  uint64 `json:"conn,omitempty"`
	Error string `json:"error,omitempty"`
}

// SameDesire compares the derivation's part of two rows.
func (w *Workload) SameDesire(o *Workload) bool {
	return w.Pod == o.Pod && w.UID == o.UID && w.Name == o.Name && w.Namespace == o.Namespace &&
		w.ServiceAccount == o.ServiceAccount && w.Netns == o.Netns && w.Problem == o.Problem
}

// sendable: the row can be handed to ztunnel.
func (w *Workload) sendable() bool { return w.Problem == "" && w.UID != "" }

// keepable: ztunnel may hold the pod, by its uid; a row with a problem is
// kept (never deleted) but not added.
func (w *Workload) keepable() bool { return w.UID != "" }

func (w *Workload) clone() *Workload { c := *w; return &c }

func (w *Workload) TableHeader() []string {
	return []string{"Pod", "UID", "ServiceAccount", "Netns", "State", "Connection", "Error"}
}

func (w *Workload) TableRow() []string {
	conn := "-"
	if w.Conn != 0 {
		conn = strconv.FormatUint(w.Conn, 10)
	}
	errText := w.Error
	if w.Problem != "" {
		errText = w.Problem
	}
	return []string{w.Pod, dash(w.UID), dash(w.ServiceAccount), dash(w.Netns), w.State, conn, dash(errText)}
}

// Connection is a ztunnel connected to the socket, once it said hello.
type Connection struct {
	ID    uint64    `json:"id"`
	Since time.Time `json:"since"`
	// Newest: adds go to this connection (dels go to all).
	Newest bool `json:"newest"`
	// SnapshotSent: the snapshot is complete, live changes flow.
	SnapshotSent bool `json:"snapshotSent"`
}

func (c *Connection) TableHeader() []string {
	return []string{"ID", "Newest", "SnapshotSent", "Since"}
}

func (c *Connection) TableRow() []string {
	return []string{strconv.FormatUint(c.ID, 10), strconv.FormatBool(c.Newest), strconv.FormatBool(c.SnapshotSent),
		c.Since.UTC().Format(time.RFC3339)}
}

var (
	workloadPodIndex = statedb.Index[*Workload, string]{
		Name:       "pod",
		FromObject: func(w *Workload) index.KeySet { return index.NewKeySet(index.String(w.Pod)) },
		FromKey:    index.String,
		FromString: index.FromString,
		Unique:     true,
	}
	workloadStateIndex = statedb.Index[*Workload, string]{
		Name:       "state",
		FromObject: func(w *Workload) index.KeySet { return index.NewKeySet(index.String(w.State)) },
		FromKey:    index.String,
		FromString: index.FromString,
	}
	connectionIDIndex = statedb.Index[*Connection, uint64]{
		Name:       "id",
		FromObject: func(c *Connection) index.KeySet { return index.NewKeySet(index.Uint64(c.ID)) },
		FromKey:    index.Uint64,
		FromString: index.Uint64String,
		Unique:     true,
	}

	// WorkloadByPod queries the row of a pod ("namespace/name").
	WorkloadByPod = workloadPodIndex.Query
	// WorkloadsByState queries the rows in a state (StateAcked, ...).
	WorkloadsByState = workloadStateIndex.Query
	// ConnectionByID queries a connection.
	ConnectionByID = connectionIDIndex.Query
)

// NewWorkloadsTable creates the zds table.
func NewWorkloadsTable(db *statedb.DB) (statedb.RWTable[*Workload], error) {
	return statedb.NewTable(db, WorkloadsTableName, workloadPodIndex, workloadStateIndex)
}

// NewConnectionsTable creates the zds-connections table.
func NewConnectionsTable(db *statedb.DB) (statedb.RWTable[*Connection], error) {
	return statedb.NewTable(db, ConnectionsTableName, connectionIDIndex)
}

// Newest returns the connection adds go to, if any.
func Newest(txn statedb.ReadTxn, conns statedb.Table[*Connection]) (*Connection, bool) {
	for c := range conns.All(txn) {
		if c.Newest {
			return c, true
		}
	}
	return nil, false
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
