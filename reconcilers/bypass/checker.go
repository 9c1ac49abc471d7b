// SPDX-License-Identifier: Apache-2.0

package bypass

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/mtlsbridge/mtlsbridge/api"
	"github.com/mtlsbridge/mtlsbridge/reconcilers"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/enrollment"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/redirect"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/steering"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/workload"
	"github.com/mtlsbridge/mtlsbridge/tables"
	"github.com/mtlsbridge/mtlsbridge/xds"
)

var (
	// ErrNotSynced is returned by a check before the pods and enrollments
	// tables are initialized: a partial view would miss pods.
	ErrNotSynced = errors.New("pods and enrollments not synced yet")
	// ErrNotReady is the module's health until the datapath of every
	// enrolled pod of this node was found in place.
	ErrNotReady = errors.New("datapath not in place")
)

// readyInterval is the period of the check until the agent is ready.
const readyInterval = time.Second

type checkerParams struct {
	cell.In

	Lifecycle   cell.Lifecycle
	Node        tables.LocalNode
	DB          *statedb.DB
	Pods        statedb.Table[*tables.Pod]
	CNIPods     statedb.Table[*tables.CNIPod]
	Enrollments statedb.Table[*enrollment.Enrollment]
	Table       statedb.RWTable[*Bypass]
	Datapath    redirect.Datapath
	Interfaces  redirect.Interfaces
	Kernel      *redirect.PinnedState
	// Without xDS in the hive there is nothing to acknowledge.
	Acks           statedb.Table[*xds.Ack] `optional:"true"`
	WorkloadConfig workload.Config         `optional:"true"`
	Metrics        *prometheus.Registry    `optional:"true"`
	// Modes: an active mode other than l2 checks the kernel itself (mode.go).
	Modes steering.Modes
}

// Checker runs the check and keeps the bypass table and the gauge.
type Checker struct {
	p      checkerParams
	kernel Kernel
	gauge  prometheus.Gauge
	// mu makes checks of the timer and of the API take turns, and guards
	// initDone.
	mu sync.Mutex
	// initDone marks the bypass table initialized, which makes the agent
	// ready (see Ready); nil once done.
	initDone func(statedb.WriteTxn)
	ready    chan struct{}
	// mode checks instead of check.go in in-pod mode; nil in l2 mode.
	mode steering.BypassChecker
}

func newChecker(p checkerParams) (*Checker, error) {
	wtxn := p.DB.WriteTxn(p.Table)
	initDone := p.Table.RegisterInitializer(wtxn, "datapath-in-place")
	wtxn.Commit()
	mode, err := modeChecker(p.Modes)
	if err != nil {
		return nil, err
	}
	c := &Checker{p: p, kernel: p.Kernel, mode: mode, initDone: initDone, ready: make(chan struct{}), gauge: prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "mtlsbridge_bypassing_pods",
		Help: "Enrolled pods of this node whose TCP may bypass the mTLS agent, at the last check",
	})}
	if p.Metrics != nil {
		if err := p.Metrics.Register(c.gauge); err != nil {
			return nil, err
		}
	}
	return c, nil
}

// Check checks every enrolled pod of this node now, writes the outcome
// into the bypass table and the gauge, and returns it sorted by pod.
//
// Possible errors: ErrNotSynced.
func (c *Checker) Check() ([]*Bypass, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	txn := c.p.DB.ReadTxn()
	for _, t := range []statedb.TableMeta{c.p.Pods, c.p.CNIPods, c.p.Enrollments} {
		if ok, _ := t.Initialized(txn); !ok {
			return nil, ErrNotSynced
		}
	}
	if c.mode != nil {
		return c.checkMode(txn, c.mode)
	}
	in := input{Now: time.Now(), Kernel: c.kernel}
	if errors.Is(c.p.Datapath.Err(), redirect.ErrDisabled) {
		in.Disabled = redirect.ErrDisabled
	}
	clusterID := c.p.WorkloadConfig.ClusterID
	if c.p.Acks != nil {
		in.Acks = func(uid string) bool { return xds.HoldsHBONE(txn, c.p.Acks, uid) }
	}
	for e := range c.p.Enrollments.List(txn, enrollment.OfThisNode()) {
		if !e.Enrolled || e.MTLSAgent {
			continue
		}
		t := target{Pod: e.Key(), UID: workload.UID(clusterID, e.Namespace, e.Pod)}
		if pod, _, ok := c.p.Pods.Get(txn, tables.PodByKey(e.Key())); ok {
			t.IPs = tables.PodAddrs(txn, c.p.CNIPods, pod) // a new sandbox's before the API has them
		}
		in.Targets = append(in.Targets, t)
	}
	if in.Disabled == nil && len(in.Targets) > 0 {
		in.Scan, in.ScanErr = c.p.Interfaces.Scan()
	}
	rows := check(in)
	return c.commit(rows, in.Disabled != nil || datapathInPlace(rows))
}

// Ready is closed once a check found the datapath of every enrolled pod of
// this node in place (or the datapath disabled by configuration). The
// bypass table is initialized at the same moment, and with it the agent's
// /healthz readiness, which waits for every table.
func (c *Checker) Ready() <-chan struct{} { return c.ready }

// datapathInPlace reports whether no row has a gap but xDS: the mTLS agent
// connects to a ready node agent, so its acknowledgements cannot be a
// condition of readiness.
func datapathInPlace(rows []*Bypass) bool {
	for _, r := range rows {
		for _, g := range r.Gaps {
			if g != GapNotAcked {
				return false
			}
		}
	}
	return true
}

func (c *Checker) loop(interval time.Duration, log *slog.Logger) func(context.Context, cell.Health) error {
	return func(ctx context.Context, health cell.Health) error {
		// Wait for the inputs, then check at once and every interval.
		if !reconcilers.WaitInitialized(ctx, health, c.p.DB, c.p.Pods, c.p.CNIPods, c.p.Enrollments) {
			return nil
		}
		// Until ready, checks come every readyInterval at most, whatever
		// the configured period (0 included).
		period := interval
		if period == 0 || period > readyInterval {
			period = readyInterval
		}
		ticker := time.NewTicker(period)
		defer ticker.Stop()
		last := -1
		for {
			rows, err := c.Check()
			if err != nil {
				health.Degraded("bypass check failed", err)
			} else {
				n := 0
				for _, r := range rows {
					if r.Bypassing {
						n++
					}
				}
				if n != last && n > 0 {
					log.Warn("Enrolled pods may bypass the mTLS agent", "pods", n, "see", "mtlsbridge bypass")
				}
				last = n
				select {
				case <-c.ready:
					// The outcome is in the table and the gauge; the
					// job itself is healthy when it could check.
					health.OK(fmt.Sprintf("ready; %d of %d enrolled pods bypassing", n, len(rows)))
				default:
					health.Degraded("not ready", fmt.Errorf("%w: %d of %d enrolled pods not redirected", ErrNotReady, n, len(rows)))
				}
			}
			select {
			case <-c.ready:
				if interval == 0 {
					return nil
				}
				if period != interval {
					period = interval
					ticker.Reset(period)
				}
			default:
			}
			select {
			case <-ctx.Done():
				return nil
			case <-ticker.C:
			}
		}
	}
}

// Report is the answer of GET /v1/bypass.
type Report struct {
	// Bypassing counts the pods with at least one gap.
	Bypassing int       `json:"bypassing"`
	Pods      []*Bypass `json:"pods"`
}

// APIPath is the route of the on-demand check on the local API.
const APIPath = "/v1/bypass"

func apiHandler(c *Checker) api.HandlerOut {
	return api.HandlerOut{Handler: api.Handler{
		Pattern: "GET " + APIPath,
		Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			rows, err := c.Check()
			if err != nil {
				code := http.StatusInternalServerError
				if errors.Is(err, ErrNotSynced) {
					code = http.StatusServiceUnavailable
				}
				http.Error(w, err.Error(), code)
				return
			}
			rep := Report{Pods: rows}
			for _, r := range rows {
				if r.Bypassing {
					rep.Bypassing++
				}
			}
			w.Header().Set("Content-Type", "application/json")
			_ = json.NewEncoder(w).Encode(rep)
		}),
	}}
}
