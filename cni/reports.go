// SPDX-License-Identifier: Apache-2.0

package cni

import (
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/cilium/statedb"
	"golang.org/x/sys/unix"

	"github.com/mtlsbridge/mtlsbridge/cni/install"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// reports keeps cni-pods rows: the plugin's reports, and the sandboxes the
// in-pod mode found that no plugin reported (tables.CNIReports).
type reports struct {
	log     *slog.Logger
	db      *statedb.DB
	cniPods statedb.RWTable[*tables.CNIPod]
	store   *store
	// first is this boot's first start of an agent.
	first FirstStart
}

var _ tables.CNIReports = reports{}

// newReports records this boot's first start of an agent, unless an
// earlier agent did.
func newReports(cfg Config, log *slog.Logger, db *statedb.DB, cniPods statedb.RWTable[*tables.CNIPod], s *store) tables.CNIReports {
	now, err := startNow()
	if err == nil && cfg.CNIInstall && chainedBeforeBoot(cfg.CNIBinDir, now) {
		// Nothing of this boot predates the plugin: the first start is
		// recorded as the boot itself.
		now.At, now.BootTime = now.At.Add(-now.BootTime), 0
	}
	var first FirstStart
	if err == nil {
		first, err = s.firstStart(now)
	}
	if err != nil {
		log.Error("Cannot tell this boot's first start of an agent: the in-pod mode finds no pod that predates the plugin", "error", err)
	}
	return reports{log: log, db: db, cniPods: cniPods, store: s, first: first}
}

// Keep checks and writes in one transaction: on disk first, so that a
// row the table shows is one a restarted agent still knows. A row the
// disk refuses is logged and kept in the table all the same: the running
// agent needs it now.
func (r reports) Keep(row *tables.CNIPod, check func(statedb.ReadTxn) error) error {
	wtxn := r.db.WriteTxn(r.cniPods)
	defer wtxn.Abort()
	if check != nil {
		if err := check(wtxn); err != nil {
			return err
		}
	}
	err := validContainerID(row.ContainerID)
	if err == nil {
		err = r.store.save(row)
	}
	if err != nil {
		r.log.Error("Cannot keep a CNI report in the state folder; a restarted agent will not know the pod's sandbox until the API or the plugin tells it again",
			"pod", row.Pod, "container", row.ContainerID, "error", err)
	}
	r.cniPods.Insert(wtxn, row)
	wtxn.Commit()
	return nil
}

// ChainedSince is when an agent of this boot first started (on today's
// wall clock): the plugin, which it chains, reports the sandboxes made
// since.
func (r reports) ChainedSince() time.Time {
	at, bootTime, err := clocks()
	if err != nil {
		return time.Time{}
	}
	return r.first.Since(at, bootTime)
}

// clocks reads the wall clock (without Go's monotonic reading) and
// CLOCK_BOOTTIME together.
func clocks() (time.Time, time.Duration, error) {
	var ts unix.Timespec
	at := time.Now().Round(0)
	if err := unix.ClockGettime(unix.CLOCK_BOOTTIME, &ts); err != nil {
		return time.Time{}, 0, err
	}
	return at, time.Duration(ts.Nano()), nil
}

// startNow is a start record for now.
func startNow() (FirstStart, error) {
	id, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return FirstStart{}, err
	}
	at, bootTime, err := clocks()
	if err != nil {
		return FirstStart{}, err
	}
	return FirstStart{At: at, BootID: strings.TrimSpace(string(id)), BootTime: bootTime}, nil
}

// chainedBeforeBoot tells whether the plugin binary installed in binDir
// dates from before the boot of start (by today's clock): the installer
// wrote it in an earlier boot, and chains it again at start. A sandbox of
// this boot made before then without it (a conflist rewritten without the
// entry, a binary left by a removal without uninstall) is not searched
// for: a loss of reach, never of safety (the first start only moves
// earlier).
func chainedBeforeBoot(binDir string, start FirstStart) bool {
	st, err := os.Stat(filepath.Join(binDir, install.PluginType))
	return err == nil && st.ModTime().Before(start.At.Add(-start.BootTime))
}

// Drop removes the row from the table and the disk.
func (r reports) Drop(row *tables.CNIPod) error {
	wtxn := r.db.WriteTxn(r.cniPods)
	r.cniPods.Delete(wtxn, row)
	wtxn.Commit()
	if validContainerID(row.ContainerID) != nil {
		return nil // never on disk
	}
	return r.store.remove(row.ContainerID)
}
