// SPDX-License-Identifier: Apache-2.0

// Package inpod is the in-pod redirection mode (--redirect-mode=inpod): the
// model of ztunnel >= 1.23, of istio-cni and of Cilium v1.20's
// encryption.type=ztunnel, without their window. For every enrolled pod of
// this node, a derivation names the pod's network namespace (from the CNI
// report of its sandbox) in two tables: inpod, the redirection to write
// there (nftables and policy routing, through netlink; a statedb
// reconciler with Update, Delete and Prune), and zds, the pod to hand to
// ztunnel over ZDS (package zds/nodeagent serves the socket). A pod is
// steered (steering.Mode) once both are done: the CNI route holds its
// start until then, readiness publishes it, and its Workload says HBONE.
// In the l2 mode the tables stay empty and the reconciler removes any
// redirection left in pods' namespaces (an enrolled pod's once the l2 mode
// steers it).
package inpod

import (
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"github.com/spf13/pflag"

	"github.com/mtlsbridge/mtlsbridge/zds/nodeagent"
)

// Cell redirects enrolled pods inside their namespace, to ztunnel.
var Cell = cell.Module(
	"inpod",
	"Enrolled pods redirected inside their own namespace to ztunnel over ZDS",

	// The pods' namespaces, through netlink. Tests of the derivation and
	// of ZDS provide another target and use Core.
	cell.Provide(newNetlinkTarget),
	Core,
)

// Core is the cell without the kernel side: configuration, tables,
// derivation, reconciler, ZDS server, mode. It needs a Target.
var Core = cell.Group(
	cell.Config(defaultConfig),
	// The module's jobs report to its own health.
	cell.ProvidePrivate(func(reg job.Registry, health cell.Health) job.Group { return reg.NewGroup(health) }),
	// The derivation writes the tables' desired side, the reconciler and
	// the ZDS server their status.
	cell.ProvidePrivate(NewRedirectionsTable, nodeagent.NewWorkloadsTable, nodeagent.NewConnectionsTable),
	// db show, readiness, the CNI route and the bypass check read them.
	cell.Provide(
		statedb.RWTable[*Redirection].ToTable,
		statedb.RWTable[*nodeagent.Workload].ToTable,
		statedb.RWTable[*nodeagent.Connection].ToTable,
	),
	// Enrolled local pods into the tables.
	cell.Invoke(registerDerivation),
	// The namespaces of enrolled pods no CNI report names, found by their
	// addresses and kept as reports.
	cell.Invoke(registerSearch),
	// Redirections into the pods' namespaces; in the l2 mode, out of them.
	cell.ProvidePrivate(newReconciler),
	cell.Invoke(func(reconciler.Reconciler[*Redirection]) {}),
	// The node's own connections to those pods (the kubelet's probes)
	// SNATed to the address their redirection lets past ztunnel; a
	// readiness warning while they are not.
	cell.ProvidePrivate(newProbeSNAT),
	cell.Provide((*probeSNAT).readinessCheck),
	cell.Invoke(func(*probeSNAT) {}),
	// inpod/prune: prune now (tests, and after repairs by hand).
	cell.Provide(scriptCommands),
	// ztunnel told of the pods over ZDS, in the inpod mode only.
	cell.Invoke(registerZDSServer),
	// Readiness, the CNI route and the bypass check ask the active mode;
	// this is the inpod one.
	cell.Provide(newMode),
)

// Config of the in-pod mode.
type Config struct {
	// ZDSSocket is where ztunnel connects (flag --zds-socket): its
	// INPOD_UDS.
	ZDSSocket string
	// NetnsDir is where the container runtime pins pods' network
	// namespaces (flag --netns-dir), searched for those no CNI report
	// names; empty: never searched.
	NetnsDir string
	// NetnsSearchMinAge is how long before the agent's first start since
	// boot a namespace must have existed to be searched (flag
	// --netns-search-min-age): one made later may have been in its CNI
	// ADD then, its addresses not yet given.
	NetnsSearchMinAge time.Duration
	// ProbeSNAT makes the node's own connections to pods redirected in
	// their namespace (the kubelet's probes) come from the probe
	// addresses, which the redirection lets past ztunnel (flag
	// --probe-snat). Off by default: it needs Cilium's legacy host
	// routing, and a policy admitting those addresses where ingress
	// policies apply (Cilium counts them as the world, not the host).
	ProbeSNAT bool
}

// DefaultZDSSocket is ztunnel's default INPOD_UDS.
const DefaultZDSSocket = "/var/run/ztunnel/ztunnel.sock"

// DefaultNetnsDir is where containerd and CRI-O pin pods' namespaces.
const DefaultNetnsDir = "/var/run/netns"

var defaultConfig = Config{ZDSSocket: DefaultZDSSocket, NetnsDir: DefaultNetnsDir, NetnsSearchMinAge: 5 * time.Minute}

// Flags implements cell.Flagger.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.String("zds-socket", def.ZDSSocket,
		"--redirect-mode=inpod: the UNIX socket ztunnel connects to (its INPOD_UDS; Cilium's chart uses /var/run/cilium/ztunnel.sock)")
	flags.String("netns-dir", def.NetnsDir,
		"--redirect-mode=inpod: the folder where the container runtime pins pods' network namespaces, searched by address for an enrolled pod no CNI report names (one started before mtlsbridge-cni was chained); empty: never searched")
	flags.Duration("netns-search-min-age", def.NetnsSearchMinAge,
		"--redirect-mode=inpod: how long before this boot's first agent start a namespace must have existed to be searched (longer than a CNI ADD takes)")
	flags.Bool("probe-snat", def.ProbeSNAT,
		"--redirect-mode=inpod: SNAT the node's own TCP connections to pods redirected in their namespace (the kubelet's probes) to 169.254.7.127 and fd16:9254:7127:1337:ffff:ffff:ffff:ffff, which the redirection lets past ztunnel, so that probes do not need ztunnel (nftables table inet mtlsbridge-probes on the node); needs Cilium's legacy host routing, and deploy/optional/mtlsbridge-probe-snat-ingress.yaml under ingress policies")
}
