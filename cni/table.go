// SPDX-License-Identifier: Apache-2.0

package cni

import (
	"net/netip"
	"strconv"
	"strings"
	"time"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"

	"github.com/mtlsbridge/mtlsbridge/tables"
)

// PodsTableName is the name of the table of what the CNI plugin reported.
const PodsTableName = "cni-pods"

// States of a cni-pods row: the last answer the plugin got.
const (
	StateAllowed = "allowed" // not enrolled, or redirected: the pod may start
	StateWaiting = "waiting" // enrolled, redirection not in place (or pod unknown)
)

// Pod is one container (sandbox) the CNI plugin asked about, with the
// addresses from its prevResult: the API has them only after ADD returns.
type Pod struct {
	ContainerID string       `json:"containerID"`
	Pod         string       `json:"pod"` // "namespace/name"
	IPs         []netip.Addr `json:"ips,omitempty"`
	Netns       string       `json:"netns,omitempty"`
	IfName      string       `json:"ifName,omitempty"`
	Enrolled    bool         `json:"enrolled"`
	Reason      string       `json:"reason,omitempty"`
	Redirect    string       `json:"redirect,omitempty"`
	State       string       `json:"state"`
	Updated     time.Time    `json:"updated"`
}

func (p *Pod) TableHeader() []string {
	return []string{"ContainerID", "Pod", "IPs", "Netns", "Enrolled", "Reason", "Redirect", "State"}
}

func (p *Pod) TableRow() []string {
	ips := make([]string, len(p.IPs))
	for i, ip := range p.IPs {
		ips[i] = ip.String()
	}
	id := p.ContainerID
	if len(id) > 12 {
		id = id[:12]
	}
	return []string{id, p.Pod, orDash(strings.Join(ips, ",")), orDash(p.Netns),
		strconv.FormatBool(p.Enrolled), orDash(p.Reason), orDash(p.Redirect), p.State}
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

var (
	containerIndex = statedb.Index[*Pod, string]{
		Name:       "container",
		FromObject: func(p *Pod) index.KeySet { return index.NewKeySet(index.String(p.ContainerID)) },
		FromKey:    index.String,
		FromString: index.FromString,
		Unique:     true,
	}
	podIndex = statedb.Index[*Pod, string]{
		Name:       "pod",
		FromObject: func(p *Pod) index.KeySet { return index.NewKeySet(tables.ExactKey(p.Pod)) },
		FromKey:    tables.ExactKey,
		FromString: tables.ExactKeyFromString,
	}

	// PodByContainer queries the row of a container id.
	PodByContainer = containerIndex.Query
	// PodsByPod queries the containers of a pod ("namespace/name").
	PodsByPod = podIndex.Query
)

// NewPodsTable creates the cni-pods table.
func NewPodsTable(db *statedb.DB) (statedb.RWTable[*Pod], error) {
	return statedb.NewTable(db, PodsTableName, containerIndex, podIndex)
}
