// SPDX-License-Identifier: Apache-2.0

// Package workload derives the workloads table: for every enrolled pod of
// the cluster, the istio.workload.Address resource the mTLS agent is told
// over delta xDS, encoded once and versioned by content.
package workload

import (
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"
)

// Cell provides the workloads table and keeps it derived.
var Cell = cell.Module(
	"workload",
	"Workload API resources of enrolled pods",

	cell.Config(defaultConfig),
	// The derivation is the table's only writer.
	cell.ProvidePrivate(NewTable),
	cell.Provide(statedb.RWTable[*Workload].ToTable),
	// The table's digest, for the xDS server's reconnects.
	cell.Provide(NewDigests),
	cell.Invoke(registerDerivation),
)

// Config of the workload resources.
type Config struct {
	// ClusterID names this cluster in workloads (flag --cluster-id).
	ClusterID string
}

// DefaultClusterID is Istio's default cluster id, which ztunnel assumes
// when a Workload names none.
const DefaultClusterID = "Kubernetes"

var defaultConfig = Config{ClusterID: DefaultClusterID}

// Flags implements cell.Flagger.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.String("cluster-id", def.ClusterID, "Cluster ID in workload resources (Istio's default: Kubernetes)")
}

func registerDerivation(p derivationParams) error {
	d, err := newDerivation(p)
	if err != nil {
		return err
	}
	p.Jobs.NewGroup(p.Health).Add(job.OneShot("derive-workloads", d.run))
	return nil
}
