// SPDX-License-Identifier: Apache-2.0

package inpod

import (
	"context"
	"errors"
	"fmt"
	"iter"
	"log/slog"
	"os"
	"slices"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"golang.org/x/time/rate"

	"github.com/mtlsbridge/mtlsbridge/reconcilers/enrollment"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/steering"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// RulesOps writes redirections into pods' namespaces.
type RulesOps struct {
	target       Target
	pods         statedb.Table[*tables.Pod]
	cniPods      statedb.Table[*tables.CNIPod]
	redirections statedb.Table[*Redirection]
	enrollments  statedb.Table[*enrollment.Enrollment]
	// active is the mode --redirect-mode names: in another than this one,
	// an enrolled pod keeps its redirection until that mode steers it
	// (unless it is switched off).
	active steering.Mode
	// waiting carries, from a prune that left redirections for the active
	// mode to steer their pods first (or failed to close a handed-over
	// pod's connections), how many and what to watch for that mode's
	// answers to change, read in the prune's own transaction (so that no
	// change after it goes unseen): pruneOnceSteered prunes again then.
	waiting chan waitingPrune
	log     *slog.Logger
	// written is the namespace each pod's redirection was last written
	// into, checked to hold the pod's addresses: a row still asks for it
	// while its path names nothing (a /proc/PID path whose process died
	// while the namespace lives on). Kept until the row goes, failed
	// updates too: should that namespace die and its inode number be
	// reused, the one protected may keep a redirection it should lose
	// (connections refused), never lose one it needs. Only the
	// reconciler's loop uses it.
	written map[string]NetnsID
}

var _ reconciler.Operations[*Redirection] = (*RulesOps)(nil)

// Update implements reconciler.Operations: the redirection is written
// (the table replaced in one transaction), after the namespace was found
// to hold the pod's addresses.
func (o *RulesOps) Update(_ context.Context, _ statedb.ReadTxn, _ statedb.Revision, r *Redirection) error {
	if r.Problem != "" {
		return errors.New(r.Problem)
	}
	id, err := o.target.Apply(r)
	if err != nil {
		return fmt.Errorf("netns %s: %w", r.Netns, err)
	}
	if o.written == nil {
		o.written = map[string]NetnsID{}
	}
	o.written[r.Pod] = id
	return nil
}

// Delete implements reconciler.Operations: the pod left, finished, or is
// no longer enrolled. A namespace that is gone is not an error, nor is one
// that a row of another pod asks for: its path may name another namespace
// now (/proc/PID/ns/net once the PID is reused). A pod that left the API
// (a pod created since under its name is another) or finished keeps its
// redirection: its sandbox may still run (a forced deletion; a terminal
// phase reported before the containers stop) and must not send in clear
// until it stops; the rules go with its namespace.
func (o *RulesOps) Delete(_ context.Context, txn statedb.ReadTxn, _ statedb.Revision, r *Redirection) error {
	delete(o.written, r.Pod)
	if r.Netns == "" {
		return nil
	}
	if o.sandboxOutlives(txn, r.Pod, r.UID) {
		o.log.Info("Leaving the in-pod redirection: the pod left the API or finished, its namespace goes with its sandbox", "pod", r.Pod, "netns", r.Netns)
		return nil
	}
	id, err := o.target.Identify(r.Netns)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("netns %s: %w", r.Netns, err)
	}
	// Errors of rows it cannot identify are the prune's to report.
	if pod, ok := o.wanted(o.redirections.All(txn)).ids[id]; ok {
		o.log.Info("Leaving the in-pod redirection: its namespace path names another pod's now", "pod", r.Pod, "netns", r.Netns, "other", pod)
		return nil
	}
	o.log.Info("Removing the in-pod redirection", "pod", r.Pod, "netns", r.Netns)
	return o.target.Remove(r.Netns, id)
}

// Prune implements reconciler.Operations: every namespace a CNI report of
// this node names, and no row asks for, loses what it holds of the
// redirection: pods unenrolled while no agent ran, or all of them once
// the mode is not inpod (an enrolled pod's once that mode steers it, and
// its connections first, see handOver). Namespaces are compared by
// identity, not path: a stale report's path may name an enrolled pod's
// namespace now. The namespace of a pod that left the API or finished
// keeps its redirection, as in Delete: its report may outlive the pod for
// a while. The reconciler prunes only once the inpod table is
// initialized, which the derivation does after cni-pods is.
func (o *RulesOps) Prune(_ context.Context, txn statedb.ReadTxn, rows iter.Seq2[*Redirection, statedb.Revision]) error {
	wanted := o.wanted(rows)
	var paths []string
	handedOver := map[string]bool{}
	awaiting := 0
	for row := range o.cniPods.All(txn) {
		if row.Netns == "" || slices.Contains(paths, row.Netns) || o.sandboxOutlives(txn, row.Pod, row.UID) {
			continue
		}
		switch o.handOverOf(txn, row) {
		case awaitingActiveMode:
			// Protected by identity, as a row's namespace: another path
			// (a stale report's) may name it.
			if id, held := o.holdsRedirection(row.Netns); held {
				wanted.ids[id] = row.Pod
				awaiting++
			}
			continue
		case steeredByActiveMode:
			handedOver[row.Netns] = true
		}
		paths = append(paths, row.Netns)
	}
	errs := wanted.errs
	failed := 0
	for _, path := range paths {
		if wanted.unidentified[path] {
			continue // its error is in errs
		}
		id, err := o.target.Identify(path)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("netns %s: %w", path, err))
			continue
		}
		if _, ok := wanted.ids[id]; ok {
			continue
		}
		present, err := o.target.Present(path, id)
		if err != nil {
			errs = append(errs, fmt.Errorf("netns %s: %w", path, err))
		}
		if !present {
			continue
		}
		if handedOver[path] {
			// The pod's connections ztunnel held (outbound ones NATed to
			// it, inbound ones it opened in a client's name) may live on
			// in the pod, their peer gone; without the rules, their next
			// segment, or a reply once conntrack forgot them, would leave
			// in clear, past the new mode, which steers new connections
			// only. Closed while the rules are in: the resets go to
			// ztunnel's side, not out of the pod.
			closed, err := o.target.CloseAll(path, id)
			switch {
			case errors.Is(err, steering.ErrCannotClose):
				// Kept for good, the rules would refuse the pod's new
				// connections: removed, with what is left of the old ones.
				o.log.Warn("Removing an in-pod redirection without closing the pod's connections: a dead one the pod writes on again will send in clear",
					"netns", path, "error", err)
			case err != nil:
				errs = append(errs, fmt.Errorf("netns %s: close the connections ztunnel held: %w", path, err))
				failed++
				continue
			default:
				o.log.Info("Closed the pod's connections of the in-pod redirection", "netns", path, "closed", closed)
			}
		}
		o.log.Info("Pruning an in-pod redirection no enrolled pod asks for", "netns", path)
		errs = append(errs, o.target.Remove(path, id))
	}
	if awaiting > 0 || failed > 0 {
		// The reconciler alone sends: a pending value is replaced.
		select {
		case <-o.waiting:
		default:
		}
		o.waiting <- waitingPrune{count: awaiting + failed, watch: o.active.Watch(txn), retry: failed > 0}
	}
	return errors.Join(errs...)
}

// sandboxOutlives reports whether the pod ("namespace/name") of that UID
// is one whose sandbox may run on without a row: the API shows it no more
// (a namesake created since, on any node, is another pod), or shows it
// finished.
func (o *RulesOps) sandboxOutlives(txn statedb.ReadTxn, key, uid string) bool {
	pod, _, found := o.pods.Get(txn, tables.PodByKey(key))
	return !found || !pod.MatchesUID(uid) || pod.Finished()
}

// handOver is where the pod of a report stands with the active mode
// when that is another than this one (the node switched to l2).
type handOver int

const (
	// notHandedOver: the in-pod mode is active, the pod is not enrolled
	// (or is the mTLS agent), or the active mode is switched off and
	// steers nothing, ever: nothing to wait for.
	notHandedOver handOver = iota
	// awaitingActiveMode: an enrolled pod the active mode does not steer
	// yet: removed now, its redirection would leave the pod sending in
	// clear until that mode steers it. A prune once it does removes it
	// (pruneOnceSteered).
	awaitingActiveMode
	// steeredByActiveMode: an enrolled pod the active mode steers.
	steeredByActiveMode
)

func (o *RulesOps) handOverOf(txn statedb.ReadTxn, report *tables.CNIPod) handOver {
	if o.active.Name() == steering.ModeInPod {
		return notHandedOver
	}
	if d, ok := o.active.(steering.Disabler); ok && d.Disabled() {
		return notHandedOver
	}
	e, _, ok := o.enrollments.Get(txn, enrollment.ByKey(report.Pod))
	if !ok || !e.Enrolled || e.MTLSAgent {
		return notHandedOver
	}
	if s, _ := o.active.Steering(txn, report.Pod, steering.Sandbox{IPs: report.IPs, Netns: report.Netns}); s != steering.Steered {
		return awaitingActiveMode
	}
	return steeredByActiveMode
}

// holdsRedirection reports whether the namespace at path holds a
// redirection now, and its identity.
func (o *RulesOps) holdsRedirection(path string) (NetnsID, bool) {
	id, err := o.target.Identify(path)
	if err != nil {
		return NetnsID{}, false
	}
	present, _ := o.target.Present(path, id)
	return id, present
}

// wantedNetns is what the rows ask for: namespaces by identity (what
// their paths name now, and where their redirection was written), each
// with its pod. A row whose path the agent cannot identify now (stat fails)
// has an error in errs, and its path in unidentified, which the prune
// skips. Another path that names its namespace is protected only by
// where its redirection was written, which an agent restarted since does
// not know.
type wantedNetns struct {
	ids          map[NetnsID]string
	unidentified map[string]bool
	errs         []error
}

func (o *RulesOps) wanted(rows iter.Seq2[*Redirection, statedb.Revision]) wantedNetns {
	w := wantedNetns{ids: map[NetnsID]string{}, unidentified: map[string]bool{}}
	for r := range rows {
		if r.Netns == "" {
			continue // no report: the sandbox was torn down
		}
		if id, ok := o.written[r.Pod]; ok {
			w.ids[id] = r.Pod
		}
		id, err := o.target.Identify(r.Netns)
		switch {
		case errors.Is(err, os.ErrNotExist):
		case err != nil:
			w.unidentified[r.Netns] = true
			w.errs = append(w.errs, fmt.Errorf("netns %s of pod %s: %w", r.Netns, r.Pod, err))
		default:
			w.ids[id] = r.Pod
		}
	}
	return w
}

type reconcilerParams struct {
	cell.In

	Params       reconciler.Params
	Log          *slog.Logger
	Target       Target
	Pods         statedb.Table[*tables.Pod]
	CNIPods      statedb.Table[*tables.CNIPod]
	Enrollments  statedb.Table[*enrollment.Enrollment]
	Modes        steering.Modes
	Redirections statedb.RWTable[*Redirection]
}

const (
	// pruneInterval bounds how long a redirection no enrolled pod asks
	// for (left by a failed delete, or by hand) survives: such a pod's
	// connections are refused. A prune opens each namespace of the node's
	// CNI reports and lists its nftables tables: cheap.
	pruneInterval = time.Minute
	// refreshInterval bounds how long a redirection altered in a pod
	// (a rule deleted by hand) stays altered; the bypass check shows it
	// meanwhile.
	refreshInterval = time.Minute
)

func newReconciler(p reconcilerParams) (reconciler.Reconciler[*Redirection], error) {
	active, err := p.Modes.Active()
	if err != nil {
		return nil, fmt.Errorf("inpod reconciler: %w", err)
	}
	ops := &RulesOps{target: p.Target, pods: p.Pods, cniPods: p.CNIPods, redirections: p.Redirections,
		enrollments: p.Enrollments, active: active, waiting: make(chan waitingPrune, 1), log: p.Log}
	r, err := reconciler.Register(p.Params, p.Redirections,
		(*Redirection).clone,
		func(r *Redirection, s reconciler.Status) *Redirection { r.Status = s; return r },
		func(r *Redirection) reconciler.Status { return r.Status },
		ops,
		nil,
		reconciler.WithName("rules"),
		reconciler.WithPruning(pruneInterval),
		reconciler.WithRefreshing(refreshInterval, rate.NewLimiter(50, 10)),
		reconciler.WithRetry(100*time.Millisecond, 10*time.Second),
	)
	if err != nil {
		return nil, fmt.Errorf("inpod reconciler: %w", err)
	}
	if active.Name() != steering.ModeInPod {
		p.Params.JobGroup.Add(job.OneShot("prune-once-steered", func(ctx context.Context, _ cell.Health) error {
			pruneOnceSteered(ctx, ops.waiting, r)
			return nil
		}))
	}
	return r, nil
}

// waitingPrune is what a prune left waiting for the active mode, or
// failed at (retry: a handed-over pod whose connections could not be
// closed keeps its rules until they are).
type waitingPrune struct {
	count int
	watch []<-chan struct{}
	retry bool
}

// pruneOnceSteered prunes again when the active mode's answers change
// after a prune left redirections for it to steer first: once it does,
// they go at once rather than at the next periodic prune (they would
// refuse the pod's connections meanwhile, with no ztunnel to serve them).
// A prune that failed to close a handed-over pod's connections is tried
// again likewise, whatever changed. A prune enters every namespace of the
// node: at most one a second, and less and less often, down to the
// periodic prune's pace, while the answers change but nothing the prune
// waits for (a pod never steered), or it keeps failing.
func pruneOnceSteered(ctx context.Context, waiting <-chan waitingPrune, r reconciler.Reconciler[*Redirection]) {
	pause, last := time.Second, 0
	for {
		var w waitingPrune
		select {
		case <-ctx.Done():
			return
		case w = <-waiting:
		}
		if last > 0 && w.count >= last {
			pause = min(2*pause, pruneInterval)
		} else {
			pause = time.Second
		}
		last = w.count
		if !w.retry {
			ws := statedb.NewWatchSet()
			ws.Add(w.watch...)
			// Settle: the datapath writes many rows at once.
			if _, err := ws.Wait(ctx, 100*time.Millisecond); err != nil {
				return
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(pause):
		}
		r.Prune()
	}
}
