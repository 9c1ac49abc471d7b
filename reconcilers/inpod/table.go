// SPDX-License-Identifier: Apache-2.0

package inpod

import (
	"net/netip"
	"slices"
	"strings"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
	"github.com/cilium/statedb/reconciler"

	"github.com/mtlsbridge/mtlsbridge/tables"
)

// TableName is the name of the table of in-pod redirections.
const TableName = "inpod"

// Redirection is the in-pod redirection one enrolled pod of this node
// needs in its network namespace.
type Redirection struct {
	// Pod is "namespace/name", UID its UID: a pod created since under that
	// name is another pod.
	Pod string `json:"pod"`
	UID string `json:"uid,omitempty"`
	// Netns is the path of the pod's network namespace, from the CNI
	// report of its newest sandbox.
	Netns string `json:"netns"`
	// IPs are the pod's addresses: the namespace must hold them, and the
	// IPv6 policy route is written only for a pod with an IPv6 address.
	IPs []netip.Addr `json:"ips"`
	// Problem says why the redirection cannot be written (no namespace
	// known); the row fails with it.
	Problem string `json:"problem,omitempty"`

	Status reconciler.Status `json:"status"`
}

func (r *Redirection) sameDesire(o *Redirection) bool {
	return r.Pod == o.Pod && r.UID == o.UID && r.Netns == o.Netns && slices.Equal(r.IPs, o.IPs) && r.Problem == o.Problem
}

func (r *Redirection) clone() *Redirection { c := *r; return &c }

func (r *Redirection) TableHeader() []string {
	return []string{"Pod", "Netns", "IPs", "Status"}
}

func (r *Redirection) TableRow() []string {
	ips := make([]string, len(r.IPs))
	for i, ip := range r.IPs {
		ips[i] = ip.String()
	}
	return []string{r.Pod, tables.Dash(r.Netns), tables.Dash(strings.Join(ips, ",")), tables.StatusString(r.Status)}
}

var (
	redirectionPodIndex = statedb.Index[*Redirection, string]{
		Name:       "pod",
		FromObject: func(r *Redirection) index.KeySet { return index.NewKeySet(index.String(r.Pod)) },
		FromKey:    index.String,
		FromString: index.FromString,
		Unique:     true,
	}
	// RedirectionByPod queries the row of a pod ("namespace/name").
	RedirectionByPod = redirectionPodIndex.Query
)

// NewRedirectionsTable creates the inpod table.
func NewRedirectionsTable(db *statedb.DB) (statedb.RWTable[*Redirection], error) {
	return statedb.NewTable(db, TableName, redirectionPodIndex)
}
