// SPDX-License-Identifier: Apache-2.0

package inpod

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"

	"github.com/mtlsbridge/mtlsbridge/reconcilers"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/enrollment"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/steering"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// The search finds the network namespace of an enrolled pod of this node
// that no CNI report names: a pod that started before mtlsbridge-cni was
// chained (mtlsbridge installed on a running cluster), or whose report
// was lost. Without it such a pod is not redirected until it restarts.
// istio-cni's node agent finds them through /proc (hostPID); the agent
// looks in the folder where the runtime pins pods' namespaces
// (--netns-dir) for the one namespace that holds every address the API
// shows for the pod. None, or more than one (a dead sandbox's may hold
// them too), and the pod stays unredirected, named in the module's health
// and the log. A namespace that a report of another pod names is that
// pod's, never a candidate. The one found is kept as a report
// (tables.CNIStateFound), so that whatever reads reports (the derivation,
// the prune, the l2 mode's cleanup, a restarted agent) reads it too.
type searchParams struct {
	cell.In

	Mode        steering.Config `optional:"true"`
	Config      Config
	Log         *slog.Logger
	DB          *statedb.DB
	Jobs        job.Group
	Target      Target
	Pods        statedb.Table[*tables.Pod]
	CNIPods     statedb.Table[*tables.CNIPod]
	Enrollments statedb.Table[*enrollment.Enrollment]
	Reports     tables.CNIReports
}

// searchRetry is how soon a pod whose namespace was not found is searched
// for again when nothing about it changed; searchSettle how long a pod
// whose report went while the agent watched waits before it is searched:
// the plugin's DEL runs before Cilium's, which removes the pod's
// interface, so its dying namespace holds its addresses meanwhile.
const (
	searchRetry  = 30 * time.Second
	searchSettle = 5 * time.Second
)

type search struct {
	searchParams
	// reported are the pods the last step saw with a report.
	reported map[string]bool
	// pending are the pods without one, by key.
	pending map[string]*searchState
}

// searchState is a pod without a report: what it is searched with, and
// why it was not found.
type searchState struct {
	uid, ips  string
	notBefore time.Time
	searched  time.Time
	reason    string
}

// due is when the pod is to be searched (again).
func (st *searchState) due() time.Time {
	if st.searched.IsZero() {
		return st.notBefore
	}
	return st.searched.Add(searchRetry)
}

func registerSearch(p searchParams) {
	s := &search{searchParams: p, reported: map[string]bool{}, pending: map[string]*searchState{}}
	p.Jobs.Add(job.OneShot("search-unreported-netns", s.run))
}

func (s *search) run(ctx context.Context, health cell.Health) error {
	if s.Mode.Mode() != steering.ModeInPod || s.Config.NetnsDir == "" {
		health.OK("inactive: no search of pods' namespaces")
		return nil
	}
	if !reconcilers.WaitInitialized(ctx, health, s.DB, s.Enrollments, s.Pods, s.CNIPods) {
		return nil
	}
	ws := statedb.NewWatchSet()
	for {
		txn := s.DB.ReadTxn()
		pods, reported, watches := s.unreported(txn)
		next := s.step(txn, pods, reported, time.Now())
		if err := s.notFound(); err != nil {
			health.Degraded("pods not redirected: their namespace is in no CNI report, nor found in "+s.Config.NetnsDir, err)
		} else {
			health.OK(fmt.Sprintf("%d pods without a CNI report to search for", len(s.pending)))
		}
		ws.Clear()
		ws.Add(watches...)
		waitCtx, cancel := ctx, context.CancelFunc(func() {})
		if !next.IsZero() {
			waitCtx, cancel = context.WithDeadline(ctx, next)
		}
		_, err := ws.Wait(waitCtx, 0)
		cancel()
		if ctx.Err() != nil {
			return nil
		}
		if err != nil && !errors.Is(err, context.DeadlineExceeded) {
			return err
		}
	}
}

// unreported are the pods the in-pod derivation redirects whose
// namespace no CNI report names, and that have addresses to search by;
// reported, those a report names.
func (s *search) unreported(txn statedb.ReadTxn) (pods []*tables.Pod, reported map[string]bool, watches []<-chan struct{}) {
	enrollments, enrollWatch := s.Enrollments.ListWatch(txn, enrollment.OfThisNode())
	_, podsWatch := s.Pods.ListWatch(txn, tables.PodsOfThisNode())
	_, cniWatch := s.CNIPods.AllWatch(txn)
	reported = map[string]bool{}
	for e := range enrollments {
		if !e.Enrolled || e.MTLSAgent {
			continue
		}
		pod, _, ok := s.Pods.Get(txn, tables.PodByKey(e.Key()))
		switch {
		case !ok || pod.HostNetwork || pod.Finished():
		case newestReport(txn, s.CNIPods, pod) != nil:
			reported[pod.Key()] = true
		case len(pod.IPs) > 0:
			pods = append(pods, pod)
		}
	}
	return pods, reported, []<-chan struct{}{enrollWatch, podsWatch, cniWatch}
}

// step searches for the pods that are due and keeps a report for each one
// found. It returns when the next search is due (zero: none pending).
func (s *search) step(txn statedb.ReadTxn, pods []*tables.Pod, reported map[string]bool, now time.Time) time.Time {
	var due []*tables.Pod
	pending := map[string]*searchState{}
	for _, pod := range pods {
		st, ok := s.pending[pod.Key()]
		if !ok || st.uid != pod.UID || st.ips != fmt.Sprint(pod.IPs) {
			st = &searchState{uid: pod.UID, ips: fmt.Sprint(pod.IPs)}
			if s.reported[pod.Key()] {
				st.notBefore = now.Add(searchSettle)
			}
		}
		pending[pod.Key()] = st
		if !now.Before(st.due()) {
			due = append(due, pod)
		}
	}
	s.pending, s.reported = pending, reported
	if len(due) > 0 {
		s.search(txn, due, now)
	}
	var next time.Time
	for _, st := range s.pending {
		if next.IsZero() || st.due().Before(next) {
			next = st.due()
		}
	}
	return next
}

func (s *search) search(txn statedb.ReadTxn, pods []*tables.Pod, now time.Time) {
	// A namespace a report names (under whatever path) is its pod's.
	reported := map[NetnsID]bool{}
	for row := range s.CNIPods.All(txn) {
		if id, err := s.Target.Identify(row.Netns); err == nil && row.Netns != "" {
			reported[id] = true
		}
	}
	namespaces, errs := s.Target.Namespaces(s.Config.NetnsDir)
	namespaces = slices.DeleteFunc(namespaces, func(ns Namespace) bool { return reported[ns.ID] })
	for _, pod := range pods {
		st := s.pending[pod.Key()]
		st.searched = now
		ns, err := matchNamespace(pod.IPs, namespaces)
		if err == nil {
			err = s.keep(pod, ns, now)
		}
		if err == nil {
			s.Log.Info("Found the network namespace of a pod no CNI report names", "pod", pod.Key(), "netns", ns.Path)
			delete(s.pending, pod.Key())
			continue
		}
		if len(errs) > 0 {
			err = fmt.Errorf("%w (%d namespaces not read: %w)", err, len(errs), errors.Join(errs...))
		}
		if st.reason != err.Error() {
			s.Log.Warn("Cannot redirect an enrolled pod: its network namespace is in no CNI report, nor found",
				"pod", pod.Key(), "folder", s.Config.NetnsDir, "error", err)
		}
		st.reason = err.Error()
	}
}

func (s *search) keep(pod *tables.Pod, ns Namespace, now time.Time) error {
	return s.Reports.Keep(&tables.CNIPod{
		ContainerID: foundContainerID(ns.Path), Pod: pod.Key(), UID: pod.UID, IPs: pod.IPs, Netns: ns.Path,
		Enrolled: true, Reason: "no CNI report; found by its addresses in " + s.Config.NetnsDir,
		State: tables.CNIStateFound, Updated: now,
	})
}

// notFound says which pods were searched for in vain, and why.
func (s *search) notFound() error {
	var errs []error
	for pod, st := range s.pending {
		if st.reason != "" {
			errs = append(errs, fmt.Errorf("%s: %s", pod, st.reason))
		}
	}
	slices.SortFunc(errs, func(a, b error) int { return strings.Compare(a.Error(), b.Error()) })
	return errors.Join(errs...)
}

// Why a pod's namespace is not found.
var (
	ErrNetnsNotFound  = errors.New("no network namespace holds the pod's addresses")
	ErrNetnsAmbiguous = errors.New("several network namespaces hold the pod's addresses")
)

// matchNamespace is the one namespace holding every one of ips.
func matchNamespace(ips []netip.Addr, namespaces []Namespace) (Namespace, error) {
	var holding []Namespace
	for _, ns := range namespaces {
		holds := !slices.ContainsFunc(ips, func(ip netip.Addr) bool { return !slices.Contains(ns.IPs, ip) })
		// Pinned twice, a namespace is still one.
		if holds && !slices.ContainsFunc(holding, func(h Namespace) bool { return h.ID == ns.ID }) {
			holding = append(holding, ns)
		}
	}
	switch len(holding) {
	case 0:
		return Namespace{}, fmt.Errorf("%w (%s)", ErrNetnsNotFound, ips)
	case 1:
		return holding[0], nil
	}
	paths := make([]string, len(holding))
	for i, ns := range holding {
		paths[i] = ns.Path
	}
	return Namespace{}, fmt.Errorf("%w: %s", ErrNetnsAmbiguous, strings.Join(paths, ", "))
}

// foundContainerID names the row of a namespace found: no container id is
// known, and the row is replaced, not added to, should the same namespace
// be found again.
func foundContainerID(path string) string {
	h := fnv.New64a()
	h.Write([]byte(path))
	return fmt.Sprintf("found-%016x", h.Sum64())
}
