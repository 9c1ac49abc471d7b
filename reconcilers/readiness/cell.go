// SPDX-License-Identifier: Apache-2.0

// Package readiness derives, for the pods of this node, whether their
// redirection is really in place (the active redirection mode answers
// steering.Steered: in l2 mode the datapath's rows are all reconciled), and
// publishes it: the ready-annotations table, read
// by this node's xDS for its own pods, and in Kubernetes mode the
// annotation mtlsbridge.io/redirect=ready on each such pod, which every
// other node reads to decide whether to send it HBONE.
package readiness

import (
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
)

// Cell keeps the ready-annotations table derived and published.
var Cell = cell.Module(
	"readiness",
	"Local pods whose redirection is in place published on them",

	// The module's jobs and reconciler report to its own health.
	cell.ProvidePrivate(func(reg job.Registry, health cell.Health) job.Group { return reg.NewGroup(health) }),
	// The derivation is the only writer, besides the publisher's status.
	cell.ProvidePrivate(NewTable),
	// xDS reads it for this node's pods; db show for operators.
	cell.Provide(statedb.RWTable[*ReadyAnnotation].ToTable),
	// From the active mode's answers into the table.
	cell.Invoke(registerDerivation),
	// In Kubernetes mode, the table onto the pods' annotations.
	cell.Invoke(registerPublisher),
)
