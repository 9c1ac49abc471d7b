// SPDX-License-Identifier: Apache-2.0

package inpod

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"maps"
	"net/netip"
	"os"
	"path/filepath"
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
// that no CNI report names because it started before mtlsbridge-cni was
// chained (mtlsbridge installed on a running cluster). Without it such a
// pod is not redirected until it restarts.
// istio-cni's node agent finds them through /proc (hostPID); the agent
// looks in the folder where the runtime pins pods' namespaces
// (--netns-dir).
//
// A wrong answer would hand one pod's identity to another pod's
// namespace, so a namespace is chosen only when nothing speaks against
// it: it is the one namespace of the folder, every entry read, whose
// addresses are exactly those the API shows for the pod (loopback and
// link-local aside); it existed --netns-search-min-age before the agent
// first started since the node booted (tables.CNIReports.ChainedSince: a
// sandbox made since went through the plugin, one made just before may
// have been in its ADD, and after a reboot the API shows addresses of
// sandboxes gone, which new ones may hold); it is not Cilium's health
// endpoint's; no report names it (a namespace is compared by identity,
// under whatever path); no other pod the API shows has any of those
// addresses (a deleted pod's may be reused); and a second search,
// searchConfirm later, finds the same. A pod whose report went while
// the agent watched (a CNI DEL) is searched for only reportGoneWait later:
// its next sandbox is reported meanwhile. The one found is kept as a report
// (tables.CNIStateFound, no addresses: the API's count), so that whatever
// reads reports (the derivation, the prune, the l2 mode's cleanup, a
// restarted agent) reads it too; it is dropped once its namespace is gone
// or holds other addresses, another pod shows one of them, or a report
// names the pod's sandbox or that namespace.
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

const (
	// searchConfirm is how long after a namespace is found it must be
	// found again to be kept.
	searchConfirm = 5 * time.Second
	// reportGoneWait is how long a pod whose report went is not searched
	// for.
	reportGoneWait = 2 * time.Minute
	// searchRetry is how soon a pod not found is searched for again when
	// nothing about it changed, and how often the namespaces kept are
	// checked.
	searchRetry = 30 * time.Second
)

// Why a pod's namespace is not found.
var (
	ErrNetnsNotFound     = errors.New("no network namespace holds exactly the pod's addresses")
	ErrNetnsAmbiguous    = errors.New("several network namespaces hold the pod's addresses")
	ErrAddressShared     = errors.New("the API shows the pod's addresses for another pod too")
	ErrNetnsUnreadable   = errors.New("the namespaces are not all read, so none is chosen")
	ErrNetnsTooNew       = errors.New("the namespace holding the pod's addresses is younger than the agent's first start since boot (less --netns-search-min-age): it should have a CNI report")
	ErrNetnsReported     = errors.New("the namespace holding the pod's addresses is named by another pod's CNI report")
	ErrNetnsNotPod       = errors.New("the namespace holding the pod's addresses is Cilium's health endpoint's")
	ErrFirstStartUnknown = errors.New("this boot's first agent start is unknown (see the cni module's log), so no namespace is old enough")
)

// ciliumHealthNetns is the namespace Cilium pins for its health endpoint:
// it holds an address of the pods' range, which a pod's stale status may
// show.
const ciliumHealthNetns = "cilium-health"

type search struct {
	searchParams
	// reported are the pods the last step saw with a report.
	reported map[string]bool
	// pending are the pods without one, by key.
	pending map[string]*searchState
	// checked is when the namespaces kept were last checked.
	checked time.Time
}

// searchState is a pod without a report, as long as it shows the same
// UID and addresses.
type searchState struct {
	uid, ips string
	// reportGone: when the plugin's report of its sandbox went, while
	// the agent watched.
	reportGone time.Time
	// candidate is the namespace the last search found, since then.
	candidate *Namespace
	since     time.Time
	searched  time.Time
	// reason is why the last search found none.
	reason string
}

// due is when the pod is to be searched for.
func (st *searchState) due() time.Time {
	switch {
	case st.candidate != nil:
		return st.since.Add(searchConfirm)
	case st.searched.IsZero() && !st.reportGone.IsZero():
		return st.reportGone.Add(reportGoneWait)
	case st.searched.IsZero():
		return time.Time{}
	}
	return st.searched.Add(searchRetry)
}

func registerSearch(p searchParams) error {
	if p.Config.NetnsSearchMinAge < 0 {
		return fmt.Errorf("--netns-search-min-age=%s: must not be negative", p.Config.NetnsSearchMinAge)
	}
	s := &search{searchParams: p, reported: map[string]bool{}, pending: map[string]*searchState{}}
	p.Jobs.Add(job.OneShot("search-unreported-netns", s.run))
	return nil
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
// namespace no report names, and that have addresses to search by;
// reported, those the plugin reported (not those found).
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
		if !ok || pod.HostNetwork || pod.Finished() {
			continue
		}
		if s.sandboxReported(txn, pod) {
			reported[pod.Key()] = true
		}
		if newestReport(txn, s.CNIPods, pod) == nil && len(pod.IPs) > 0 {
			pods = append(pods, pod)
		}
	}
	return pods, reported, []<-chan struct{}{enrollWatch, podsWatch, cniWatch}
}

// step searches for the pods that are due, keeps what is confirmed and
// checks what was kept. It returns when to step again (zero: on changes
// only).
func (s *search) step(txn statedb.ReadTxn, pods []*tables.Pod, reported map[string]bool, now time.Time) time.Time {
	var due []*tables.Pod
	pending := map[string]*searchState{}
	for _, pod := range pods {
		st, ok := s.pending[pod.Key()]
		if !ok || st.uid != pod.UID || st.ips != fmt.Sprint(pod.IPs) {
			st = &searchState{uid: pod.UID, ips: fmt.Sprint(pod.IPs)}
			if s.reported[pod.Key()] {
				st.reportGone = now
			}
		}
		pending[pod.Key()] = st
		if !now.Before(st.due()) {
			due = append(due, pod)
		}
	}
	if len(due) > 0 {
		// The folder is listed: every pod not found is searched again
		// (one listing, not one per pod).
		for _, pod := range pods {
			if st := pending[pod.Key()]; st.reason != "" && now.Before(st.due()) {
				due = append(due, pod)
			}
		}
	}
	s.pending, s.reported = pending, reported
	// What was kept is checked with every listing, at least every
	// searchRetry.
	found := s.found(txn)
	if len(due) > 0 || (len(found) > 0 && now.Sub(s.checked) >= searchRetry) {
		l := s.list(txn)
		s.check(txn, found, l)
		s.checked = now
		if len(due) > 0 {
			s.search(txn, due, l, now)
		}
	}
	var next time.Time
	if len(found) > 0 {
		next = s.checked.Add(searchRetry)
	}
	for _, st := range s.pending {
		if at := st.due(); next.IsZero() || at.Before(next) {
			next = at
		}
	}
	return next
}

// listing is what a step reads once, for the check and the search: the
// folder's namespaces, the entries that could not be read, and the
// namespaces reports name (incomplete when a report's path could not be
// identified).
type listing struct {
	namespaces []Namespace
	errs       map[string]error
	reported   map[NetnsID][]string
	incomplete error
}

func (s *search) list(txn statedb.ReadTxn) listing {
	var l listing
	l.namespaces, l.errs = s.Target.Namespaces(s.Config.NetnsDir)
	l.reported, l.incomplete = s.reportedNamespaces(txn)
	return l
}

func (s *search) search(txn statedb.ReadTxn, pods []*tables.Pod, l listing, now time.Time) {
	incomplete := l.incomplete
	if incomplete == nil && len(l.errs) > 0 {
		incomplete = unreadable(l.errs)
	}
	chained := s.Reports.ChainedSince()
	if incomplete == nil && chained.IsZero() {
		incomplete = ErrFirstStartUnknown
	}
	before := chained.Add(-s.Config.NetnsSearchMinAge)
	for _, pod := range pods {
		st := s.pending[pod.Key()]
		st.searched = now
		var ns Namespace
		err := incomplete
		if err == nil {
			// Among every namespace listed: one that may not be chosen
			// holding the addresses too makes the choice ambiguous.
			ns, err = matchNamespace(pod.IPs, l.namespaces)
		}
		switch {
		case err != nil:
		case len(l.reported[ns.ID]) > 0:
			err = fmt.Errorf("%w: %s, of %s", ErrNetnsReported, ns.Path, strings.Join(l.reported[ns.ID], ", "))
		case filepath.Base(ns.Path) == ciliumHealthNetns:
			err = fmt.Errorf("%w: %s", ErrNetnsNotPod, ns.Path)
		case !ns.ExistsSince.Before(before):
			err = fmt.Errorf("%w: %s exists since %s", ErrNetnsTooNew, ns.Path, ns.ExistsSince.Format(time.RFC3339))
		default:
			err = s.eligible(txn, pod)
		}
		switch {
		case err != nil:
			st.candidate = nil
			if st.reason != err.Error() {
				s.Log.Warn("Cannot redirect an enrolled pod: its network namespace is in no CNI report, nor found",
					"pod", pod.Key(), "folder", s.Config.NetnsDir, "error", err)
			}
			st.reason = err.Error()
		case st.candidate == nil || st.candidate.ID != ns.ID || st.candidate.Path != ns.Path:
			st.candidate, st.since, st.reason = &ns, now, ""
		case now.Sub(st.since) >= searchConfirm:
			if err := s.keep(pod, ns, now); err != nil {
				st.candidate, st.reason = nil, err.Error()
				s.Log.Warn("Found the network namespace of a pod no CNI report names, but not kept", "pod", pod.Key(), "netns", ns.Path, "error", err)
				continue
			}
			s.Log.Info("Found the network namespace of a pod no CNI report names", "pod", pod.Key(), "netns", ns.Path)
			delete(s.pending, pod.Key())
		}
	}
}

// reportedNamespaces are the namespaces reports name, with the pods whose
// reports name them; a report whose path cannot be identified (but for a
// namespace gone) makes it incomplete.
func (s *search) reportedNamespaces(txn statedb.ReadTxn) (map[NetnsID][]string, error) {
	reported := map[NetnsID][]string{}
	errs := map[string]error{}
	for row := range s.CNIPods.All(txn) {
		if row.Netns == "" {
			continue
		}
		id, err := s.Target.Identify(row.Netns)
		switch {
		case err == nil:
			reported[id] = append(reported[id], row.Pod)
		case !errors.Is(err, os.ErrNotExist):
			errs[row.Netns] = err
		}
	}
	if len(errs) > 0 {
		return reported, unreadable(errs)
	}
	return reported, nil
}

func unreadable(errs map[string]error) error {
	paths := slices.Sorted(maps.Keys(errs))
	joined := make([]error, len(paths))
	for i, path := range paths {
		joined[i] = fmt.Errorf("%s: %w", path, errs[path])
	}
	return fmt.Errorf("%w (%d not read): %w", ErrNetnsUnreadable, len(paths), errors.Join(joined...))
}

// eligible tells whether the pod, as txn shows it, may still be given a
// namespace found for it: unchanged, enrolled, unreported, its addresses
// its own.
func (s *search) eligible(txn statedb.ReadTxn, pod *tables.Pod) error {
	cur, _, ok := s.Pods.Get(txn, tables.PodByKey(pod.Key()))
	e, _, enrolled := s.Enrollments.Get(txn, enrollment.ByKey(pod.Key()))
	switch {
	case !ok || cur.UID != pod.UID || !slices.Equal(cur.IPs, pod.IPs) || cur.Finished() || cur.HostNetwork:
		return errors.New("the pod changed meanwhile")
	case !enrolled || !e.Enrolled || e.MTLSAgent:
		return errors.New("the pod is no longer enrolled")
	case newestReport(txn, s.CNIPods, cur) != nil:
		return errors.New("its sandbox was reported meanwhile")
	}
	return s.addressesShared(txn, cur)
}

// addressesShared tells whether another pod the API shows (not finished,
// not on the host's network) has any of the pod's addresses.
func (s *search) addressesShared(txn statedb.ReadTxn, pod *tables.Pod) error {
	var others []string
	for _, ip := range pod.IPs {
		for other := range s.Pods.List(txn, tables.PodsByIP(ip)) {
			if other.Key() != pod.Key() && !other.Finished() && !other.HostNetwork && !slices.Contains(others, other.Key()) {
				others = append(others, other.Key())
			}
		}
	}
	if len(others) > 0 {
		return fmt.Errorf("%w: %s", ErrAddressShared, strings.Join(others, ", "))
	}
	return nil
}

// keep writes the report of the namespace found, unless, in the write
// transaction, the pod is no longer eligible or a report names its
// namespace now.
func (s *search) keep(pod *tables.Pod, ns Namespace, now time.Time) error {
	row := &tables.CNIPod{
		ContainerID: foundContainerID(ns.Path), Pod: pod.Key(), UID: pod.UID, Netns: ns.Path,
		Enrolled: true, Reason: "no CNI report; found by its addresses in " + s.Config.NetnsDir,
		State: tables.CNIStateFound, Updated: now,
	}
	return s.Reports.Keep(row, func(txn statedb.ReadTxn) error {
		if err := s.eligible(txn, pod); err != nil {
			return err
		}
		reported, err := s.reportedNamespaces(txn)
		if owners := reported[ns.ID]; len(owners) > 0 {
			return fmt.Errorf("%s is named by a report of %s now", ns.Path, strings.Join(owners, ", "))
		}
		return err
	})
}

// found are the reports the search kept.
func (s *search) found(txn statedb.ReadTxn) []*tables.CNIPod {
	var rows []*tables.CNIPod
	for row := range s.CNIPods.All(txn) {
		if row.State == tables.CNIStateFound {
			rows = append(rows, row)
		}
	}
	return rows
}

// check drops a kept report whose namespace is gone or no longer holds
// exactly the pod's addresses, or that a report of the pod's sandbox, or
// of another pod naming that namespace, supersedes.
func (s *search) check(txn statedb.ReadTxn, found []*tables.CNIPod, l listing) {
	byPath := map[string]Namespace{}
	for _, ns := range l.namespaces {
		byPath[ns.Path] = ns
	}
	for _, row := range found {
		pod, _, ok := s.Pods.Get(txn, tables.PodByKey(row.Pod))
		if !ok {
			continue // gone from the API: package cni drops it
		}
		ns, listed := byPath[row.Netns]
		_, identifyErr := s.Target.Identify(row.Netns)
		// Listed fine, the folder passes over what is no namespace.
		dir := filepath.Clean(s.Config.NetnsDir)
		inFolder := filepath.Dir(row.Netns) == dir && l.errs[dir] == nil && l.errs[row.Netns] == nil
		shared := s.addressesShared(txn, pod)
		var why string
		switch {
		case s.sandboxReported(txn, pod):
			why = "the pod's sandbox is reported"
		case shared != nil:
			why = shared.Error()
		case !listed && (errors.Is(identifyErr, os.ErrNotExist) || inFolder):
			why = "its namespace is gone"
		case !listed:
			// Not read now, or in another folder (an earlier --netns-dir):
			// only what is seen drops it.
			continue
		case len(others(l.reported[ns.ID], row.Pod)) > 0:
			why = "a report of " + strings.Join(others(l.reported[ns.ID], row.Pod), ", ") + " names its namespace"
		case !sameAddrs(ns.IPs, pod.IPs):
			why = "its namespace does not hold exactly the pod's addresses any more"
		default:
			continue
		}
		if err := s.Reports.Drop(row); err != nil {
			s.Log.Warn("Cannot drop a network namespace found for a pod", "pod", row.Pod, "netns", row.Netns, "error", err)
			continue
		}
		s.Log.Info("Dropped the network namespace found for a pod", "pod", row.Pod, "netns", row.Netns, "reason", why)
	}
}

// others are the pods but pod.
func others(pods []string, pod string) []string {
	return slices.DeleteFunc(slices.Clone(pods), func(p string) bool { return p == pod })
}

// sandboxReported tells whether a report of the plugin names a
// namespace of the pod.
func (s *search) sandboxReported(txn statedb.ReadTxn, pod *tables.Pod) bool {
	for row := range s.CNIPods.List(txn, tables.CNIPodsByPod(pod.Key())) {
		if row.State != tables.CNIStateFound && row.Netns != "" && pod.MatchesUID(row.UID) {
			return true
		}
	}
	return false
}

// notFound says which pods were searched for in vain, and why.
func (s *search) notFound() error {
	var errs []error
	for _, pod := range slices.Sorted(maps.Keys(s.pending)) {
		if reason := s.pending[pod].reason; reason != "" {
			errs = append(errs, fmt.Errorf("%s: %s", pod, reason))
		}
	}
	return errors.Join(errs...)
}

// matchNamespace is the one namespace whose addresses are exactly ips.
func matchNamespace(ips []netip.Addr, namespaces []Namespace) (Namespace, error) {
	var holding []Namespace
	for _, ns := range namespaces {
		// Pinned twice, a namespace is still one.
		if sameAddrs(ns.IPs, ips) && !slices.ContainsFunc(holding, func(h Namespace) bool { return h.ID == ns.ID }) {
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
	slices.Sort(paths)
	return Namespace{}, fmt.Errorf("%w: %s", ErrNetnsAmbiguous, strings.Join(paths, ", "))
}

// sameAddrs compares a namespace's addresses with a pod's, leaving out
// those every namespace has (loopback, link-local).
func sameAddrs(held, pod []netip.Addr) bool {
	return slices.Equal(podAddrSet(held), podAddrSet(pod))
}

func podAddrSet(addrs []netip.Addr) []netip.Addr {
	set := make([]netip.Addr, 0, len(addrs))
	for _, a := range addrs {
		a = a.Unmap()
		if a.IsLoopback() || a.IsLinkLocalUnicast() || a.IsMulticast() || a.IsUnspecified() {
			continue
		}
		set = append(set, a)
	}
	slices.SortFunc(set, netip.Addr.Compare)
	return slices.Compact(set)
}

// foundContainerID names the row of a namespace found: no container id is
// known, and the row is replaced, not added to, should the same namespace
// be found again.
func foundContainerID(path string) string {
	h := fnv.New64a()
	h.Write([]byte(path))
	return fmt.Sprintf("found-%016x", h.Sum64())
}
