// SPDX-License-Identifier: Apache-2.0

package inpod

import (
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/mtlsbridge/mtlsbridge/reconcilers/steering"
	"github.com/mtlsbridge/mtlsbridge/zds/nodeagent"
)

type zdsParams struct {
	cell.In

	Config       Config
	Mode         steering.Config `optional:"true"`
	Log          *slog.Logger
	DB           *statedb.DB
	Jobs         job.Group
	Target       Target
	Redirections statedb.Table[*Redirection]
	Workloads    statedb.RWTable[*nodeagent.Workload]
	Conns        statedb.RWTable[*nodeagent.Connection]
	Registry     *prometheus.Registry `optional:"true"`
}

// registerZDSServer serves ztunnel in the inpod mode. A pod's namespace is
// opened when it is sent, checked to hold the pod's addresses.
func registerZDSServer(p zdsParams) error {
	if p.Mode.Mode() != steering.ModeInPod {
		return nil
	}
	var reg prometheus.Registerer
	if p.Registry != nil {
		reg = p.Registry
	}
	metrics, err := nodeagent.NewMetrics(reg)
	if err != nil {
		return err
	}
	s := nodeagent.NewServer(nodeagent.Params{
		Log: p.Log, DB: p.DB, Workloads: p.Workloads, Conns: p.Conns, Path: p.Config.ZDSSocket, Metrics: metrics,
		Open: openChecked(p.DB, p.Redirections, p.Target),
	})
	// A socket that cannot be made (its folder not mounted yet) is tried
	// again; meanwhile the job's health says why.
	p.Jobs.Add(job.OneShot("zds-server", s.Run, job.WithRetry(-1, &job.ExponentialBackoff{Min: time.Second, Max: time.Minute})))
	return nil
}

// openChecked opens a pod's namespace for ztunnel, checked to hold the
// pod's addresses. Never unchecked: rows that disagree are changing (a
// new sandbox), and a path may name another pod's namespace by now. The
// add is retried once they agree.
func openChecked(db *statedb.DB, redirections statedb.Table[*Redirection], target Target) func(*nodeagent.Workload) (*os.File, error) {
	return func(w *nodeagent.Workload) (*os.File, error) {
		r, _, ok := redirections.Get(db.ReadTxn(), RedirectionByPod(w.Pod))
		if !ok || r.Netns != w.Netns {
			return nil, fmt.Errorf("%w: the pod's redirection does not name %s (yet)", ErrNetnsUnchecked, w.Netns)
		}
		return target.Open(w.Netns, r.IPs)
	}
}
