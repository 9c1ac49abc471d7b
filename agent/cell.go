// SPDX-License-Identifier: Apache-2.0

// Package agent composes the cells of the mtlsbridge node agent.
package agent

import (
	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"

	"github.com/mtlsbridge/mtlsbridge/api"
	"github.com/mtlsbridge/mtlsbridge/cni"
	"github.com/mtlsbridge/mtlsbridge/grpcserver"
	"github.com/mtlsbridge/mtlsbridge/identity"
	"github.com/mtlsbridge/mtlsbridge/metrics"
	"github.com/mtlsbridge/mtlsbridge/nodenetns"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/bypass"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/enrollment"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/inpod"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/readiness"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/redirect"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/steering"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/workload"
	"github.com/mtlsbridge/mtlsbridge/statedir"
	"github.com/mtlsbridge/mtlsbridge/tables"
	"github.com/mtlsbridge/mtlsbridge/tables/ingest"
	"github.com/mtlsbridge/mtlsbridge/xds"
)

// Infrastructure is what every mtlsbridge hive needs, tests included.
var Infrastructure = cell.Group(
	cell.SimpleHealthCell, // health of jobs
	// ... shown by the shell's "health" command.
	cell.Provide(func(h *cell.SimpleHealth) hive.ScriptCmdOut {
		return hive.NewScriptCmd("health", cell.SimpleHealthCmd(h))
	}),
	job.Cell,      // managed goroutines
	statedb.Cell,  // the in-memory database and its script commands
	metrics.Cell,  // the Prometheus registry every component registers with
	statedir.Cell, // the private state folder: sockets, CNI reports, CA of folder mode
)

// Cell is the node agent without its infrastructure.
var Cell = cell.Group(
	tables.Cell,     // identity of this node
	ingest.Cell,     // Kubernetes or manifest folder into tables
	enrollment.Cell, // enrollments: who is in, and why
	steering.Cell,   // --redirect-mode: which of the two modes below steers enrolled pods
	nodenetns.Cell,  // the node's network namespace, where both modes act on the node
	redirect.Cell,   // l2 mode: redirects and attachments, enrolled pods' TCP steered to the mTLS agent in the kernel
	inpod.Cell,      // inpod mode: redirection inside each enrolled pod, which ZDS hands to ztunnel
	readiness.Cell,  // ready-annotations: local pods whose redirection is in place, published on them
	api.Cell,        // local API and read-only shell: table dumps, health, metrics
	grpcserver.Cell, // TLS gRPC listener for the mTLS agent, caller authentication
	identity.Cell,   // certificate authority for the mTLS agent
	workload.Cell,   // workloads: the Workload API resources of enrolled pods
	xds.Cell,        // delta xDS for the mTLS agent
	bypass.Cell,     // bypass: enrolled pods checked against the kernel and xDS acknowledgements
	cni.Cell,        // chained CNI plugin: enrolled pods start only once redirected; its installer
)

// SignerCell is the signer without its infrastructure: the one holder of
// the CA key, which signs for each node agent the identities of its own
// node's enrolled pods (node agents run with --ca-upstream).
var SignerCell = cell.Group(
	tables.Cell,     // no node of its own: the cluster's enrolled pods
	ingest.Cell,     // Kubernetes or manifest folder into tables
	enrollment.Cell, // who is enrolled, and on which node
	api.Cell,        // local API and read-only shell
	grpcserver.Cell, // TLS gRPC listener
	grpcserver.NodeAgentCallersCell,
	identity.Cell, // the certificate authority
)
