// SPDX-License-Identifier: Apache-2.0

// Package bypass checks, for every pod of this node that the rules enroll,
// that its TCP really goes through the node's mTLS agent: not what the
// redirect reconcilers believe they wrote, but what the kernel holds now
// (the pinned redirect map, the TCX chain of the pod's interface, the
// agent's interface), and that the mTLS agent acknowledged the pod's
// Workload with HBONE over xDS. Each gap is a reason on the pod's row of
// the bypass table; mtlsbridge_bypassing_pods counts the pods with one.
// GET /v1/bypass on the local API checks now; `mtlsbridge bypass` is its
// client.
//
// The module also makes the agent's readiness: the bypass table stays
// uninitialized, and with it /healthz and the module's health say not
// ready, until a check finds every enrolled pod of the node with its
// datapath in place (xDS acknowledgements aside: the mTLS agent connects
// to a ready node agent). Readiness latches; later gaps show in the table
// and the gauge. With --ready-taint, the node's taint is then removed.
package bypass

import (
	"fmt"
	"log/slog"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"
)

// Cell checks periodically and on demand that enrolled pods cannot bypass
// the mTLS agent.
var Cell = cell.Module(
	"bypass",
	"Enrolled pods checked against the kernel for ways around the mTLS agent",

	cell.Config(defaultConfig),
	// The check's job reports to the module's health.
	cell.ProvidePrivate(func(reg job.Registry, health cell.Health) job.Group { return reg.NewGroup(health) }),
	// The checker is the only writer of the table.
	cell.ProvidePrivate(NewTable),
	// db show bypass, the API and tests read it.
	cell.Provide(statedb.RWTable[*Bypass].ToTable),
	// The checker: kernel reader, xDS acknowledgements, gauge.
	cell.Provide(newChecker),
	// Periodic check into the table and the gauge.
	cell.Invoke(registerJob),
	// GET /v1/bypass: check now.
	cell.Provide(apiHandler),
	// In Kubernetes mode, --ready-taint removed from the node once ready;
	// a removal that fails is logged and fails readiness.
	cell.ProvidePrivate(func() *taintState { return &taintState{} }),
	cell.Provide(taintCheck),
	cell.Invoke(registerTaintRemoval),
)

// Config of the check.
type Config struct {
	// BypassCheckInterval is the period of the check (flag
	// --bypass-check-interval); 0 turns the periodic check off once the
	// agent is ready, the API still checks on demand. Until ready, the
	// check runs every second.
	BypassCheckInterval time.Duration
	// ReadyTaint is a node taint "KEY:EFFECT" to remove once the agent is
	// ready (flag --ready-taint), e.g. mtlsbridge.io/agent-not-ready:NoSchedule
	// put on the node when it registers; empty: none.
	ReadyTaint string
}

var defaultConfig = Config{BypassCheckInterval: 30 * time.Second}

// Flags implements cell.Flagger.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.Duration("bypass-check-interval", def.BypassCheckInterval,
		"Period of the check that enrolled pods cannot bypass the mTLS agent (0: once ready, only on demand, GET /v1/bypass)")
	flags.String("ready-taint", def.ReadyTaint,
		"Node taint KEY:EFFECT removed once the agent is ready (e.g. mtlsbridge.io/agent-not-ready:NoSchedule); needs --source=k8s")
}

func (c Config) validate() error {
	if c.BypassCheckInterval < 0 {
		return fmt.Errorf("%T.BypassCheckInterval (--bypass-check-interval) must not be negative", c)
	}
	return nil
}

func registerJob(cfg Config, c *Checker, jobs job.Group, log *slog.Logger) error {
	if err := cfg.validate(); err != nil {
		return err
	}
	// With the period 0 the job still runs until the agent is ready.
	jobs.Add(job.OneShot("bypass-check", c.loop(cfg.BypassCheckInterval, log)))
	return nil
}
