// SPDX-License-Identifier: Apache-2.0

package redirect

import (
	"context"
	"errors"
	"fmt"
	"iter"
	"log/slog"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"golang.org/x/time/rate"
)

// MapOps writes redirects into the redirect map.
type MapOps struct {
	dp  Datapath
	log *slog.Logger
}

var _ reconciler.Operations[*Redirect] = (*MapOps)(nil)

// Update implements reconciler.Operations. A row with a problem leaves the
// map as it is (and fails, so that its status shows the problem): the
// entry a previous agent wrote stays until the problem is solved or the
// row goes.
func (o *MapOps) Update(_ context.Context, _ statedb.ReadTxn, _ statedb.Revision, r *Redirect) error {
	if r.Problem != "" {
		return errors.New(r.Problem)
	}
	return o.dp.UpdateEntry(r.Addr, r.Entry())
}

// Delete implements reconciler.Operations.
func (o *MapOps) Delete(_ context.Context, _ statedb.ReadTxn, _ statedb.Revision, r *Redirect) error {
	return o.dp.DeleteEntry(r.Addr)
}

// Prune implements reconciler.Operations: entries of addresses no row asks
// for go, e.g. those of pods deleted while the agent was down. The
// reconciler calls it only once the redirects table is initialized, which
// the derivation does only after all of its inputs are and an interface
// scan succeeded.
func (o *MapOps) Prune(_ context.Context, _ statedb.ReadTxn, rows iter.Seq2[*Redirect, statedb.Revision]) error {
	have, err := o.dp.Entries()
	if err != nil {
		return err
	}
	for r := range rows {
		delete(have, r.Addr)
	}
	var errs []error
	for addr := range have {
		o.log.Info("Pruning stale redirect entry", "addr", addrString(addr))
		errs = append(errs, o.dp.DeleteEntry(addr))
	}
	return errors.Join(errs...)
}

// AttachOps keeps programs attached to devices.
type AttachOps struct {
	dp  Datapath
	log *slog.Logger
}

var _ reconciler.Operations[*Attachment] = (*AttachOps)(nil)

// Update implements reconciler.Operations: attaches, or swaps in this
// agent's program, keeping it first on the device.
func (o *AttachOps) Update(_ context.Context, _ statedb.ReadTxn, _ statedb.Revision, a *Attachment) error {
	if a.Problem != "" {
		return errors.New(a.Problem)
	}
	return o.dp.Attach(a.Hook, a.Device, a.Ifindex)
}

// Delete implements reconciler.Operations.
func (o *AttachOps) Delete(_ context.Context, _ statedb.ReadTxn, _ statedb.Revision, a *Attachment) error {
	return o.dp.Detach(a.Device)
}

// Prune implements reconciler.Operations: links of devices no row asks for
// are released.
func (o *AttachOps) Prune(_ context.Context, _ statedb.ReadTxn, rows iter.Seq2[*Attachment, statedb.Revision]) error {
	attached, err := o.dp.Attached()
	if err != nil {
		return err
	}
	want := map[string]bool{}
	for a := range rows {
		want[a.Device] = true
	}
	var errs []error
	for device := range attached {
		if !want[device] {
			o.log.Info("Pruning stale attachment", "device", device)
			errs = append(errs, o.dp.Detach(device))
		}
	}
	return errors.Join(errs...)
}

type reconcilerParams struct {
	cell.In

	Params      reconciler.Params
	Log         *slog.Logger
	Datapath    Datapath
	Redirects   statedb.RWTable[*Redirect]
	Attachments statedb.RWTable[*Attachment]
}

const (
	// pruneInterval bounds how long an entry or link nobody asks for
	// (written by hand, or left by a failed delete) survives.
	pruneInterval = 5 * time.Minute
	// refreshAttachments bounds how long another program may run before
	// ours on a device.
	refreshAttachments = time.Minute
)

func registerReconcilers(p reconcilerParams) error {
	if errors.Is(p.Datapath.Err(), ErrDisabled) || errors.Is(p.Datapath.Err(), ErrInactive) {
		return nil // the derivation's rows say that nothing is applied, or there are none
	}
	_, err := reconciler.Register(p.Params, p.Redirects,
		(*Redirect).clone,
		func(r *Redirect, s reconciler.Status) *Redirect { r.Status = s; return r },
		func(r *Redirect) reconciler.Status { return r.Status },
		&MapOps{dp: p.Datapath, log: p.Log},
		nil,
		reconciler.WithName("map"),
		reconciler.WithPruning(pruneInterval),
		reconciler.WithRetry(100*time.Millisecond, 10*time.Second),
	)
	if err != nil {
		return fmt.Errorf("redirects reconciler: %w", err)
	}
	_, err = reconciler.Register(p.Params, p.Attachments,
		(*Attachment).clone,
		func(a *Attachment, s reconciler.Status) *Attachment { a.Status = s; return a },
		func(a *Attachment) reconciler.Status { return a.Status },
		&AttachOps{dp: p.Datapath, log: p.Log},
		nil,
		reconciler.WithName("attach"),
		reconciler.WithPruning(pruneInterval),
		// Update also puts the program back in front when another was
		// attached before it since (Cilium re-attaching its own).
		reconciler.WithRefreshing(refreshAttachments, rate.NewLimiter(100, 10)),
		reconciler.WithRetry(100*time.Millisecond, 10*time.Second),
	)
	if err != nil {
		return fmt.Errorf("attachments reconciler: %w", err)
	}
	return nil
}
