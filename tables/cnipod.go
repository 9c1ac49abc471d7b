// SPDX-License-Identifier: Apache-2.0

package tables

import (
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
)

// CNIPodsTableName is the name of the table of what the CNI plugin reported.
const CNIPodsTableName = "cni-pods"

// States of a cni-pods row: the last answer the plugin got.
const (
	CNIStateAllowed = "allowed" // not enrolled, or redirected: the pod may start
	CNIStateWaiting = "waiting" // enrolled, redirection not in place (or pod unknown)
	// CNIStateFound: no plugin reported the sandbox (it started before
	// the plugin was in the chain); the in-pod mode found its namespace.
	CNIStateFound = "found"
)

// CNIReports keeps cni-pods rows as the plugin's reports are kept: in the
// state folder, so that a restarted agent knows them too, and in the
// table. Package cni provides it.
type CNIReports interface {
	// Keep writes row, unless check, given the write transaction, says
	// why not (nil: always): then it returns check's error.
	Keep(row *CNIPod, check func(statedb.ReadTxn) error) error
	// Drop removes row.
	Drop(row *CNIPod) error
	// ChainedSince is when an agent first started since the node booted
	// (on today's wall clock; zero when unknown): the plugin it chains
	// reports the sandboxes made since (but under a fail-open policy, or
	// before the agent chained it).
	ChainedSince() time.Time
}

// CNIPod is one container (sandbox) the CNI plugin asked about at ADD, with
// the addresses from its prevResult. It is the only source of a new pod's
// addresses until the ADD returns: only then does the kubelet write
// status.podIPs. Package cni writes the table (and keeps it in the state
// folder across agent restarts); the derivations read it through PodAddrs.
type CNIPod struct {
	ContainerID string       `json:"containerID" yaml:"containerID"`
	Pod         string       `json:"pod" yaml:"pod"` // "namespace/name"
	UID         string       `json:"uid,omitempty" yaml:"uid,omitempty"`
	IPs         []netip.Addr `json:"ips,omitempty" yaml:"ips,omitempty"`
	Netns       string       `json:"netns,omitempty" yaml:"netns,omitempty"`
	IfName      string       `json:"ifName,omitempty" yaml:"ifName,omitempty"`
	Enrolled    bool         `json:"enrolled" yaml:"enrolled"`
	Reason      string       `json:"reason,omitempty" yaml:"reason,omitempty"`
	Redirect    string       `json:"redirect,omitempty" yaml:"redirect,omitempty"`
	State       string       `json:"state" yaml:"state"`
	Updated     time.Time    `json:"updated" yaml:"updated"`
}

func (p *CNIPod) TableHeader() []string {
	return []string{"ContainerID", "Pod", "IPs", "Netns", "Enrolled", "Reason", "Redirect", "State"}
}

func (p *CNIPod) TableRow() []string {
	ips := make([]string, len(p.IPs))
	for i, ip := range p.IPs {
		ips[i] = ip.String()
	}
	id := p.ContainerID
	if len(id) > 12 {
		id = id[:12]
	}
	return []string{id, p.Pod, Dash(strings.Join(ips, ",")), Dash(p.Netns),
		strconv.FormatBool(p.Enrolled), Dash(p.Reason), Dash(p.Redirect), p.State}
}

var (
	cniContainerIndex = statedb.Index[*CNIPod, string]{
		Name:       "container",
		FromObject: func(p *CNIPod) index.KeySet { return index.NewKeySet(index.String(p.ContainerID)) },
		FromKey:    index.String,
		FromString: index.FromString,
		Unique:     true,
	}
	cniPodIndex = statedb.Index[*CNIPod, string]{
		Name:       "pod",
		FromObject: func(p *CNIPod) index.KeySet { return index.NewKeySet(ExactKey(p.Pod)) },
		FromKey:    ExactKey,
		FromString: ExactKeyFromString,
	}

	// cniIPIndex finds a sandbox by address (on-demand xDS), before the
	// API shows it on the pod.
	cniIPIndex = statedb.Index[*CNIPod, netip.Addr]{
		Name:       "ip",
		FromObject: func(p *CNIPod) index.KeySet { return addrKeys(p.IPs) },
		FromKey:    index.NetIPAddr,
		FromString: index.NetIPAddrString,
	}

	// CNIPodByContainer queries the row of a container id.
	CNIPodByContainer = cniContainerIndex.Query
	// CNIPodsByPod queries the containers of a pod ("namespace/name").
	CNIPodsByPod = cniPodIndex.Query
	// CNIPodsByIP queries the containers reported with an address.
	CNIPodsByIP = cniIPIndex.Query
)

// NewCNIPodsTable creates the cni-pods table.
func NewCNIPodsTable(db *statedb.DB) (statedb.RWTable[*CNIPod], error) {
	return statedb.NewTable(db, CNIPodsTableName, cniContainerIndex, cniPodIndex, cniIPIndex)
}

// PodAddrs returns the addresses of a pod as the node knows them best: those
// of its newest sandbox the CNI plugin reported, else those of the API. The
// plugin's report is newer whenever they differ: at the first ADD the API
// has none, and after a sandbox is recreated (a node reboot) the API shows
// the old sandbox's until the ADD of the new one returns. Reports of
// another pod of the same name (a different UID) do not count.
func PodAddrs(txn statedb.ReadTxn, cniPods statedb.Table[*CNIPod], pod *Pod) []netip.Addr {
	var newest *CNIPod
	for row := range cniPods.List(txn, CNIPodsByPod(pod.Key())) {
		if len(row.IPs) == 0 || !pod.MatchesUID(row.UID) {
			continue
		}
		if newest == nil || row.Updated.After(newest.Updated) {
			newest = row
		}
	}
	if newest == nil {
		return pod.IPs
	}
	return newest.IPs
}

// WithPodAddrs returns the pod itself, or a copy with the addresses of
// PodAddrs when they differ from the API's.
func WithPodAddrs(txn statedb.ReadTxn, cniPods statedb.Table[*CNIPod], pod *Pod) *Pod {
	addrs := PodAddrs(txn, cniPods, pod)
	if slices.Equal(addrs, pod.IPs) {
		return pod
	}
	c := *pod
	c.IPs = addrs
	return &c
}
