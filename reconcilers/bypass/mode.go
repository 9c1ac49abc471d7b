// SPDX-License-Identifier: Apache-2.0

package bypass

import (
	"slices"
	"strings"
	"time"

	"github.com/cilium/statedb"

	"github.com/mtlsbridge/mtlsbridge/reconcilers/enrollment"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/steering"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/workload"
	"github.com/mtlsbridge/mtlsbridge/tables"
	"github.com/mtlsbridge/mtlsbridge/xds"
)

// modeChecker returns the active mode when it checks the kernel itself
// (in-pod mode); nil for the l2 mode, which check.go checks.
func modeChecker(modes steering.Modes) (steering.BypassChecker, error) {
	mode, err := modes.Active()
	if err != nil {
		return nil, err
	}
	bc, _ := mode.(steering.BypassChecker)
	return bc, nil
}

// checkMode is Check in a mode that checks the kernel itself: the same
// targets, the mode's gaps, the same xDS acknowledgement, the same table,
// gauge and readiness. The caller holds c.mu and checked that the inputs
// are synced.
func (c *Checker) checkMode(txn statedb.ReadTxn, bc steering.BypassChecker) ([]*Bypass, error) {
	now := time.Now()
	clusterID := c.p.WorkloadConfig.ClusterID
	var targets []steering.Target
	for e := range c.p.Enrollments.List(txn, enrollment.OfThisNode()) {
		if !e.Enrolled || e.MTLSAgent {
			continue
		}
		t := steering.Target{Pod: e.Key()}
		if pod, _, ok := c.p.Pods.Get(txn, tables.PodByKey(e.Key())); ok {
			t.UID = pod.UID
			t.IPs = tables.PodAddrs(txn, c.p.CNIPods, pod)
		}
		targets = append(targets, t)
	}
	found := bc.CheckBypass(txn, targets)
	rows := make([]*Bypass, 0, len(targets))
	inPlace := true
	for _, t := range targets {
		gaps := slices.Clone(found[t.Pod])
		inPlace = inPlace && len(gaps) == 0
		ns, name, _ := strings.Cut(t.Pod, "/")
		if c.p.Acks != nil && !xds.HoldsHBONE(txn, c.p.Acks, workload.UID(clusterID, ns, name)) {
			gaps = append(gaps, GapNotAcked) // as in l2 mode: not a condition of readiness
		}
		rows = append(rows, row(now, t.Pod, gaps))
	}
	return c.commit(sortRows(rows), inPlace)
}

// commit writes a check's rows into the table and the gauge, and latches
// readiness when the datapath is in place.
func (c *Checker) commit(rows []*Bypass, inPlace bool) ([]*Bypass, error) {
	wtxn := c.p.DB.WriteTxn(c.p.Table)
	defer wtxn.Abort()
	if err := c.p.Table.DeleteAll(wtxn); err != nil {
		return nil, err
	}
	bypassing := 0
	for _, r := range rows {
		if r.Bypassing {
			bypassing++
		}
		if _, _, err := c.p.Table.Insert(wtxn, r); err != nil {
			return nil, err
		}
	}
	nowReady := c.initDone != nil && inPlace
	if nowReady {
		c.initDone(wtxn)
		c.initDone = nil
	}
	wtxn.Commit()
	if nowReady {
		close(c.ready) // after the commit: whoever wakes sees the table initialized
	}
	c.gauge.Set(float64(bypassing))
	return rows, nil
}
