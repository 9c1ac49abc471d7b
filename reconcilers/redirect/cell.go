// SPDX-License-Identifier: Apache-2.0

// Package redirect keeps the kernel datapath of CFP-32759 equal to what the
// tables ask for on this node. A derivation turns enrollments, pods, the
// node's addresses and the interfaces found through netlink into two
// tables of desired state: redirects (entries of the redirect map) and
// attachments (programs on devices). Two statedb reconcilers write them
// into the kernel with Update, Delete and Prune; every row shows its
// status. Map and links are pinned under --bpf-root, so a restarting agent
// leaves the datapath running and takes it over without a gap. In
// Kubernetes mode a third table, ready-annotations, publishes on each local
// pod whether its redirection is really in place.
package redirect

import (
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"
)

// Cell steers enrolled pods' TCP to the node's mTLS agent.
var Cell = cell.Module(
	"redirect",
	"Enrolled pods TCP steered to the node mTLS agent in the kernel",

	// The kernel side: BPF objects pinned under --bpf-root, and netlink;
	// with --enable-redirect=false, stand-ins that touch nothing. Tests of
	// the derivation and the reconcilers provide their own and use Core.
	cell.Provide(newDatapath, newNetlinkInterfaces),
	// The pinned state as it is, read anew at each call (the bypass check).
	cell.Provide(newPinnedState),
	// In another mode, what an earlier l2 agent left pinned is handed
	// over to it pod by pod, then goes.
	cell.Invoke(registerHandover),
	Core,
)

// Core is the cell without the kernel side: configuration, tables,
// derivation and reconcilers. It needs a Datapath and Interfaces.
var Core = cell.Group(
	cell.Config(defaultConfig),
	// The module's jobs report to its own health.
	cell.ProvidePrivate(newJobGroup),
	// The derivation is the only writer of the tables, besides the
	// reconcilers' status updates.
	cell.ProvidePrivate(NewRedirectsTable, NewAttachmentsTable),
	// Everyone else reads them: db show, readiness, the CNI route.
	cell.Provide(
		statedb.RWTable[*Redirect].ToTable,
		statedb.RWTable[*Attachment].ToTable,
	),
	// Tables of desired state, from enrollments, pods, the node and the
	// interfaces; without a datapath, they say what would be steered.
	cell.Invoke(registerDerivation),
	// Desired state into the map and onto the devices.
	cell.Invoke(registerReconcilers),
	// redirect/map and redirect/attached: the kernel's view, for the shell.
	cell.Provide(scriptCommands),
	// Warnings in /healthz: Cilium must let the mTLS agent send with other
	// pods' addresses; some device must take HBONE from other nodes.
	cell.Provide(checkSourceIP, checkNodeIngress),
	// Readiness, the CNI route and the bypass check ask the active mode;
	// this is the l2 one.
	cell.Provide(NewL2Mode),
)

// Config of the datapath.
type Config struct {
	// EnableRedirect turns the datapath on (flag --enable-redirect).
	EnableRedirect bool
	// BPFRoot is the agent's folder on bpffs for the map and the links
	// (flag --bpf-root). Only root may write there.
	BPFRoot string
	// Devices are the node's uplinks: HBONE from other nodes arrives there
	// in native routing (flag --devices; NAME+ stands for every device
	// NAME prefixes). Empty: the devices that look like uplinks.
	Devices []string
	// TunnelDevices are Cilium's tunnel devices, where HBONE from other
	// nodes arrives decapsulated in its tunnel routing mode, and its
	// WireGuard device, where it arrives decrypted in native routing.
	// Each that exists gets the node-ingress program (flag
	// --tunnel-devices).
	TunnelDevices []string
}

var defaultConfig = Config{
	EnableRedirect: true,
	BPFRoot:        "/sys/fs/bpf/mtlsbridge",
	TunnelDevices:  []string{"cilium_vxlan", "cilium_geneve", "cilium_wg0"},
}

// Flags implements cell.Flagger.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.Bool("enable-redirect", def.EnableRedirect, "Steer enrolled pods' TCP to the node's mTLS agent with BPF")
	flags.String("bpf-root", def.BPFRoot, "Folder on bpffs for the agent's pinned map and links (created writable by root only)")
	flags.StringSlice("devices", def.Devices, "Uplink devices of the node, where HBONE (port 15008) from other nodes arrives in native routing (NAME+: every device NAME prefixes); empty: found as Cilium finds its devices")
	flags.StringSlice("tunnel-devices", def.TunnelDevices, "Cilium's tunnel devices and WireGuard device, where HBONE from other nodes arrives decapsulated (tunnel routing) or decrypted (native routing with WireGuard); each that exists gets the node-ingress program")
}

func newJobGroup(reg job.Registry, health cell.Health) job.Group { return reg.NewGroup(health) }
