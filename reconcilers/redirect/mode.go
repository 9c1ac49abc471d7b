// SPDX-License-Identifier: Apache-2.0

package redirect

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"

	"github.com/mtlsbridge/mtlsbridge/bpf"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/steering"
	"github.com/mtlsbridge/mtlsbridge/statedir"
)

// l2Mode answers for the l2 mode from the rows of the datapath's desired
// state and their reconcile status.
type l2Mode struct {
	datapath    Datapath
	redirects   statedb.Table[*Redirect]
	attachments statedb.Table[*Attachment]
}

var (
	_ steering.Mode     = (*l2Mode)(nil)
	_ steering.Disabler = (*l2Mode)(nil)
)

// NewL2Mode puts the l2 mode into the group of redirection modes. Hives
// that provide the datapath's tables by hand (tests) provide it too.
func NewL2Mode(dp Datapath, redirects statedb.Table[*Redirect], attachments statedb.Table[*Attachment]) steering.ModeOut {
	return steering.ModeOut{Mode: &l2Mode{datapath: dp, redirects: redirects, attachments: attachments}}
}

func (m *l2Mode) Name() string { return steering.ModeL2 }

// Disabled implements steering.Disabler.
func (m *l2Mode) Disabled() bool { return errors.Is(m.datapath.Err(), ErrDisabled) }

// Steering implements steering.Mode with SteeringOf.
func (m *l2Mode) Steering(txn statedb.ReadTxn, pod string, sandbox steering.Sandbox) (steering.Steering, string) {
	if m.Disabled() {
		return NotSteered, ErrDisabled.Error()
	}
	// The datapath follows addresses and interfaces, whatever the
	// namespace: sandbox.Netns is not looked at.
	if s := SteeringOf(txn, m.redirects, m.attachments, pod, sandbox.IPs); s != Steered {
		return s, "the redirects and attachments of the reported addresses are not all done"
	}
	return Steered, ""
}

func (m *l2Mode) Watch(txn statedb.ReadTxn) []<-chan struct{} {
	_, r := m.redirects.AllWatch(txn)
	_, a := m.attachments.AllWatch(txn)
	return []<-chan struct{}{r, a}
}

func (m *l2Mode) Tables() []statedb.TableMeta {
	return []statedb.TableMeta{m.redirects, m.attachments}
}

// inactive: another mode steers the pods. The datapath then contributes
// nothing: no BPF object is loaded, no interface is watched, the tables
// stay empty (and initialized), no reconciler runs.
func inactive(mode steering.Config) bool { return mode.Mode() != steering.ModeL2 }

// removeStalePins releases, in another mode, what an earlier agent of the
// l2 mode left pinned under --bpf-root: its programs would go on steering
// pods' TCP to the mTLS agent's namespace, past the other mode's
// redirection (the BPF twin of Cilium #47303). Only our pins go: the
// links' folder and the maps; the root stays.
func removeStalePins(ctx context.Context, log *slog.Logger, root string) error {
	if _, err := os.Stat(filepath.Join(root, bpf.MapName)); errors.Is(err, os.ErrNotExist) {
		if _, err := os.Stat(filepath.Join(root, "links")); errors.Is(err, os.ErrNotExist) {
			return nil // nothing of ours: the usual case
		}
	}
	// An l2 agent still running (the other half of a rolling update)
	// holds the folder: wait for it, then take its state away.
	lock, err := statedir.LockFolder(ctx, root, "BPF root", log)
	if err != nil {
		return fmt.Errorf("--bpf-root=%s: %w", root, err)
	}
	defer lock.Release()
	links, err := os.ReadDir(filepath.Join(root, "links"))
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	var errs []error
	for _, l := range links {
		pin := filepath.Join(root, "links", l.Name())
		log.Info("Removing a program left by the l2 mode", "pin", pin)
		errs = append(errs, bpf.Detach(pin))
	}
	for _, pin := range bpf.MapPins(root) {
		if err := os.Remove(pin); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		} else if err == nil {
			log.Info("Removed a map left by the l2 mode", "pin", pin)
		}
	}
	return errors.Join(errs...)
}

type stalePinsParams struct {
	cell.In

	Config Config
	Mode   steering.Config `optional:"true"`
	Log    *slog.Logger
	Jobs   job.Group
}

// registerStalePinsRemoval runs removeStalePins once, in another mode.
func registerStalePinsRemoval(p stalePinsParams) {
	if !inactive(p.Mode) || !p.Config.EnableRedirect {
		return
	}
	p.Jobs.Add(job.OneShot("remove-l2-pins", func(ctx context.Context, health cell.Health) error {
		if err := removeStalePins(ctx, p.Log, p.Config.BPFRoot); err != nil {
			p.Log.Error("Cannot remove what the l2 mode left pinned", "root", p.Config.BPFRoot, "error", err)
			health.Degraded("l2 state left pinned", err)
			return nil
		}
		health.OK("nothing of the l2 mode pinned")
		return nil
	}))
}
