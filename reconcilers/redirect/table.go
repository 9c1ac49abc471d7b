// SPDX-License-Identifier: Apache-2.0

package redirect

import (
	"cmp"
	"encoding/json"
	"net"
	"net/netip"
	"strconv"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
	"github.com/cilium/statedb/reconciler"

	"github.com/mtlsbridge/mtlsbridge/bpf"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// Table names.
const (
	RedirectsTableName   = "redirects"
	AttachmentsTableName = "attachments"
)

// AgentAddr is how the agent's entry (bpf.AgentKey) is written in tables
// and queries.
const AgentAddr = "agent"

// Redirect is one desired entry of the redirect map of this node.
type Redirect struct {
	// Addr keys the entry: a local pod's or the node's address, or
	// bpf.AgentKey for the node's mTLS agent.
	Addr netip.Addr
	Kind bpf.Kind
	// Pod is the "namespace/name" of the pod the address belongs to; empty
	// for the node's own addresses.
	Pod string
	// FormerPod is, for a sandbox kept steered after its pod left the
	// API, the pod it ran: the row names no pod (the name may be a new
	// pod's), but `db show --pod` still finds it.
	FormerPod string
	// Interface, Ifindex and MAC locate the pod (agent) for kinds enrolled
	// and agent: the host-side interface in the node's network namespace,
	// the MAC inside the pod. NetnsID is the agent's network namespace id.
	Interface string
	Ifindex   uint32
	MAC       net.HardwareAddr
	NetnsID   int32
	// Problem says why the entry cannot be written (e.g. the pod's
	// interface was not found). The map keeps what it had for the address:
	// a transient problem never removes a live redirect.
	Problem string

	Status reconciler.Status
}

// Entry is the map value the row asks for.
func (r *Redirect) Entry() bpf.Entry {
	return bpf.Entry{Kind: r.Kind, Ifindex: r.Ifindex, MAC: r.MAC, NetnsID: r.NetnsID}
}

// sameDesire compares everything but the status.
func (r *Redirect) sameDesire(o *Redirect) bool {
	return r.Addr == o.Addr && r.Kind == o.Kind && r.Pod == o.Pod && r.FormerPod == o.FormerPod && r.Interface == o.Interface &&
		r.Ifindex == o.Ifindex && r.MAC.String() == o.MAC.String() && r.NetnsID == o.NetnsID && r.Problem == o.Problem
}

func (r *Redirect) clone() *Redirect { c := *r; return &c }

func (r *Redirect) TableHeader() []string {
	return []string{"Address", "Kind", "Pod", "Interface", "MAC", "Status"}
}

func (r *Redirect) TableRow() []string {
	mac := "-"
	if r.MAC != nil {
		mac = r.MAC.String()
	}
	iface := "-"
	if r.Interface != "" {
		iface = r.Interface + "(" + strconv.Itoa(int(r.Ifindex)) + ")"
	}
	return []string{addrString(r.Addr), r.Kind.String(), tables.Dash(r.Pod), iface, mac, tables.StatusString(r.Status)}
}

// Attachment is a program to keep attached to a device of this node.
type Attachment struct {
	// Device is the interface name in the node's network namespace.
	Device  string
	Ifindex int
	Hook    bpf.Hook
	// Pod is the "namespace/name" of the pod behind the device (from-pod);
	// FormerPod as in Redirect.
	Pod       string
	FormerPod string
	Problem   string

	Status reconciler.Status
}

func (a *Attachment) sameDesire(o *Attachment) bool {
	return a.Device == o.Device && a.Ifindex == o.Ifindex && a.Hook == o.Hook && a.Pod == o.Pod && a.FormerPod == o.FormerPod && a.Problem == o.Problem
}

func (a *Attachment) clone() *Attachment { c := *a; return &c }

func (a *Attachment) TableHeader() []string {
	return []string{"Device", "Ifindex", "Hook", "Pod", "Status"}
}

func (a *Attachment) TableRow() []string {
	ifindex := "-"
	if a.Ifindex != 0 {
		ifindex = strconv.Itoa(a.Ifindex)
	}
	return []string{a.Device, ifindex, string(a.Hook), tables.Dash(a.Pod), tables.StatusString(a.Status)}
}

var (
	redirectAddrIndex = statedb.Index[*Redirect, netip.Addr]{
		Name:       "addr",
		FromObject: func(r *Redirect) index.KeySet { return index.NewKeySet(index.NetIPAddr(r.Addr)) },
		FromKey:    index.NetIPAddr,
		FromString: func(s string) (index.Key, error) {
			if s == AgentAddr {
				return index.NetIPAddr(bpf.AgentKey), nil
			}
			return index.NetIPAddrString(s)
		},
		Unique: true,
	}
	redirectPodIndex = statedb.Index[*Redirect, string]{
		Name: "pod",
		FromObject: func(r *Redirect) index.KeySet {
			return index.NewKeySet(tables.ExactKey(r.Pod))
		},
		FromKey:    tables.ExactKey,
		FromString: tables.ExactKeyFromString,
	}
	attachmentDeviceIndex = statedb.Index[*Attachment, string]{
		Name:       "device",
		FromObject: func(a *Attachment) index.KeySet { return index.NewKeySet(index.String(a.Device)) },
		FromKey:    index.String,
		FromString: index.FromString,
		Unique:     true,
	}
	attachmentPodIndex = statedb.Index[*Attachment, string]{
		Name:       "pod",
		FromObject: func(a *Attachment) index.KeySet { return index.NewKeySet(tables.ExactKey(a.Pod)) },
		FromKey:    tables.ExactKey,
		FromString: tables.ExactKeyFromString,
	}

	// RedirectByAddr queries the entry of an address (bpf.AgentKey for the agent).
	RedirectByAddr = redirectAddrIndex.Query
	// RedirectsByPod queries the entries of a pod ("namespace/name").
	RedirectsByPod = redirectPodIndex.Query
	// AttachmentByDevice queries the attachment of a device.
	AttachmentByDevice = attachmentDeviceIndex.Query
	// AttachmentsByPod queries the attachments of a pod ("namespace/name").
	AttachmentsByPod = attachmentPodIndex.Query
)

// NewRedirectsTable creates the redirects table.
func NewRedirectsTable(db *statedb.DB) (statedb.RWTable[*Redirect], error) {
	return statedb.NewTable(db, RedirectsTableName, redirectAddrIndex, redirectPodIndex)
}

// NewAttachmentsTable creates the attachments table.
func NewAttachmentsTable(db *statedb.DB) (statedb.RWTable[*Attachment], error) {
	return statedb.NewTable(db, AttachmentsTableName, attachmentDeviceIndex, attachmentPodIndex)
}

func addrString(a netip.Addr) string {
	if a == bpf.AgentKey {
		return AgentAddr
	}
	return a.String()
}

func (r *Redirect) Scope() tables.Scope { return tables.PodScope(cmp.Or(r.Pod, r.FormerPod), "") }

func (a *Attachment) Scope() tables.Scope { return tables.PodScope(cmp.Or(a.Pod, a.FormerPod), "") }

// MarshalJSON shows a row as the table does, in the names every table uses.
func (r *Redirect) MarshalJSON() ([]byte, error) {
	var mac string
	if r.MAC != nil {
		mac = r.MAC.String()
	}
	return json.Marshal(struct {
		Addr      string            `json:"addr"`
		Kind      string            `json:"kind"`
		Pod       string            `json:"pod,omitempty"`
		FormerPod string            `json:"formerPod,omitempty"`
		Interface string            `json:"interface,omitempty"`
		Ifindex   uint32            `json:"ifindex,omitempty"`
		MAC       string            `json:"mac,omitempty"`
		NetnsID   int32             `json:"netnsID"`
		Problem   string            `json:"problem,omitempty"`
		Status    tables.StatusJSON `json:"status"`
	}{addrString(r.Addr), r.Kind.String(), r.Pod, r.FormerPod, r.Interface, r.Ifindex, mac, r.NetnsID, r.Problem, tables.NewStatusJSON(r.Status)})
}

// MarshalJSON shows a row as the table does, in the names every table uses.
func (a *Attachment) MarshalJSON() ([]byte, error) {
	return json.Marshal(struct {
		Device    string            `json:"device"`
		Ifindex   int               `json:"ifindex,omitempty"`
		Hook      string            `json:"hook"`
		Pod       string            `json:"pod,omitempty"`
		FormerPod string            `json:"formerPod,omitempty"`
		Problem   string            `json:"problem,omitempty"`
		Status    tables.StatusJSON `json:"status"`
	}{a.Device, a.Ifindex, string(a.Hook), a.Pod, a.FormerPod, a.Problem, tables.NewStatusJSON(a.Status)})
}
