// SPDX-License-Identifier: Apache-2.0

package inpod

import (
	"errors"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/statedb"

	"github.com/mtlsbridge/mtlsbridge/reconcilers/enrollment"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// searchWorld is the search over tables in memory and namespaces the
// test lists.
type searchWorld struct {
	t           *testing.T
	db          *statedb.DB
	pods        statedb.RWTable[*tables.Pod]
	cniPods     statedb.RWTable[*tables.CNIPod]
	enrollments statedb.RWTable[*enrollment.Enrollment]
	target      *searchTarget
	s           *search
}

func newSearchWorld(t *testing.T) *searchWorld {
	db := statedb.New()
	pods, err := tables.NewPodsTable(db, tables.LocalNode{NodeName: "node-a"})
	must(t, err)
	cniPods, err := tables.NewCNIPodsTable(db)
	must(t, err)
	enrollments, err := enrollment.NewTable(db, tables.LocalNode{NodeName: "node-a"})
	must(t, err)
	w := &searchWorld{t: t, db: db, pods: pods, cniPods: cniPods, enrollments: enrollments, target: &searchTarget{errs: map[string]error{}}}
	w.s = &search{
		searchParams: searchParams{Config: Config{NetnsDir: "/run/netns", NetnsSearchMinAge: 5 * time.Minute}, Log: slog.New(slog.DiscardHandler), DB: db,
			Target: w.target, Pods: pods, CNIPods: cniPods, Enrollments: enrollments, Reports: tableReportsOf{db, cniPods, time.Now()}},
		reported: map[string]bool{}, pending: map[string]*searchState{},
	}
	return w
}

// newOldPodWorld is a world with one enrolled pod, app/old, and one
// namespace holding its address, /run/netns/cni-old.
func newOldPodWorld(t *testing.T) (*searchWorld, *tables.Pod) {
	w := newSearchWorld(t)
	pod := w.addPod("old", true, "10.0.1.50")
	w.addNamespace("/run/netns/cni-old", 1, "10.0.1.50")
	return w, pod
}

// addPod puts a pod of this node in the API, enrolled or not (or its
// new addresses).
func (w *searchWorld) addPod(name string, enrolled bool, ips ...string) *tables.Pod {
	pod := &tables.Pod{Namespace: "app", Name: name, UID: name + "-1", NodeName: "node-a"}
	for _, ip := range ips {
		pod.IPs = append(pod.IPs, netip.MustParseAddr(ip))
	}
	wtxn := w.db.WriteTxn(w.pods, w.enrollments)
	w.pods.Insert(wtxn, pod)
	w.enrollments.Insert(wtxn, &enrollment.Enrollment{Namespace: "app", Pod: name, UID: pod.UID, Node: "node-a", Enrolled: enrolled})
	wtxn.Commit()
	return pod
}

func (w *searchWorld) addNamespace(path string, ino uint64, ips ...string) {
	ns := Namespace{Path: path, ID: NetnsID{Ino: ino}}
	for _, ip := range append(ips, "127.0.0.1", "::1", "fe80::1") {
		ns.IPs = append(ns.IPs, netip.MustParseAddr(ip))
	}
	w.target.namespaces = append(w.target.namespaces, ns)
}

func (w *searchWorld) report(row *tables.CNIPod) {
	wtxn := w.db.WriteTxn(w.cniPods)
	w.cniPods.Insert(wtxn, row)
	wtxn.Commit()
}

func (w *searchWorld) unreport(containerID string) {
	wtxn := w.db.WriteTxn(w.cniPods)
	row, _, _ := w.cniPods.Get(wtxn, tables.CNIPodByContainer(containerID))
	w.cniPods.Delete(wtxn, row)
	wtxn.Commit()
}

// step runs a step of the job at now.
func (w *searchWorld) step(now time.Time) time.Time {
	txn := w.db.ReadTxn()
	pods, reported, _ := w.s.unreported(txn)
	return w.s.step(txn, pods, reported, now)
}

// kept is the namespace kept for pod, if any.
func (w *searchWorld) kept(pod *tables.Pod) string {
	for row := range w.cniPods.List(w.db.ReadTxn(), tables.CNIPodsByPod(pod.Key())) {
		if row.State == tables.CNIStateFound {
			return row.Netns
		}
	}
	return ""
}

func (w *searchWorld) reason(pod *tables.Pod) string {
	if st := w.s.pending[pod.Key()]; st != nil {
		return st.reason
	}
	return ""
}

// TestSearchConfirms: a namespace found is kept only when found again
// searchConfirm later; one not found is searched again after
// searchRetry, or at once when the pod's addresses change; a pod whose
// plugin report went (a CNI DEL) is not searched while it shows the same
// addresses, but one whose found namespace was dropped is.
func TestSearchConfirms(t *testing.T) {
	w := newSearchWorld(t)
	old := w.addPod("old", true, "10.0.1.50", "fd00::50")
	w.addNamespace("/run/netns/cni-old", 1, "10.0.1.50", "fd00::50")
	t0 := time.Now()
	if next := w.step(t0); w.target.searches != 1 || w.kept(old) != "" || !next.Equal(t0.Add(searchConfirm)) {
		t.Fatalf("first search: %d searches, kept %q, next +%v; want 1, none, +%v", w.target.searches, w.kept(old), next.Sub(t0), searchConfirm)
	}
	w.step(t0.Add(searchConfirm / 2))
	if w.target.searches != 1 {
		t.Errorf("searched again before searchConfirm")
	}
	w.step(t0.Add(searchConfirm))
	if got := w.kept(old); got != "/run/netns/cni-old" {
		t.Fatalf("confirmed: kept %q, want /run/netns/cni-old", got)
	}
	row, _, _ := w.cniPods.Get(w.db.ReadTxn(), tables.CNIPodByContainer(foundContainerID("/run/netns/cni-old")))
	if row.UID != "old-1" || len(row.IPs) != 0 || !row.Enrolled {
		t.Errorf("kept %+v, want old's UID and no addresses (the API's count)", row)
	}
	// Its namespace goes: dropped at the next check, then searched for.
	w.target.namespaces = nil
	t1 := t0.Add(searchConfirm + searchRetry)
	w.step(t1)
	if w.kept(old) != "" {
		t.Fatalf("kept %q, its namespace gone", w.kept(old))
	}
	w.step(t1)
	if st := w.s.pending["app/old"]; st == nil || st.searched.IsZero() {
		t.Errorf("not searched for once its namespace found was dropped: %+v", st)
	}

	// Not found: searched again after searchRetry, or when it moves.
	lost := w.addPod("lost", true, "10.0.1.60")
	t2 := t1.Add(time.Minute)
	if next := w.step(t2); !strings.Contains(w.reason(lost), ErrNetnsNotFound.Error()) || !next.Equal(t2.Add(searchRetry)) {
		t.Fatalf("not found: reason %q, next +%v", w.reason(lost), next.Sub(t2))
	}
	lostSearched := func() time.Time { return w.s.pending["app/lost"].searched }
	w.step(t2.Add(searchRetry / 2))
	if !lostSearched().Equal(t2) {
		t.Errorf("searched again before searchRetry")
	}
	w.addPod("lost", true, "10.0.1.61")
	w.step(t2.Add(searchRetry / 2))
	if !lostSearched().Equal(t2.Add(searchRetry / 2)) {
		t.Errorf("not searched at once when the pod's addresses changed")
	}

	// gone's sandbox report goes (a DEL) while its dying namespace holds
	// its addresses: not searched for reportGoneWait.
	gone := w.addPod("gone", true, "10.0.1.70")
	w.addNamespace("/run/netns/cni-dying", 7, "10.0.1.70")
	w.report(&tables.CNIPod{ContainerID: "c-gone", Pod: "app/gone", UID: "gone-1", Netns: "/run/netns/cni-dying"})
	t3 := t2.Add(time.Minute)
	w.step(t3)
	w.unreport("c-gone")
	for _, at := range []time.Duration{0, searchConfirm, searchRetry, reportGoneWait - time.Second} {
		w.step(t3.Add(at))
	}
	if st := w.s.pending["app/gone"]; st == nil || !st.searched.IsZero() || w.kept(gone) != "" {
		t.Errorf("a pod whose report went: %+v, kept %q; want pending, not searched, none kept", st, w.kept(gone))
	}
	w.step(t3.Add(reportGoneWait))
	if st := w.s.pending["app/gone"]; st == nil || st.searched.IsZero() {
		t.Errorf("a pod whose report went, after reportGoneWait: %+v, want searched", st)
	}
}

// TestSearchConfirmsTheSame: a second listing that finds the namespace
// under another path (or another namespace under the same path) starts
// the confirmation again.
func TestSearchConfirmsTheSame(t *testing.T) {
	for _, tc := range []struct {
		name string
		ns   Namespace
	}{
		{"same namespace, another path", Namespace{Path: "/run/netns/cni-moved", ID: NetnsID{Ino: 1}}},
		{"same path, another namespace", Namespace{Path: "/run/netns/cni-old", ID: NetnsID{Ino: 9}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w, pod := newOldPodWorld(t)
			t0 := time.Now()
			w.step(t0)
			w.target.namespaces = nil
			w.addNamespace(tc.ns.Path, tc.ns.ID.Ino, "10.0.1.50")
			if next := w.step(t0.Add(searchConfirm)); w.kept(pod) != "" || !next.Equal(t0.Add(2*searchConfirm)) {
				t.Fatalf("kept %q, next +%v; want none, the confirmation again", w.kept(pod), next.Sub(t0))
			}
			w.step(t0.Add(2 * searchConfirm))
			if got := w.kept(pod); got != tc.ns.Path {
				t.Errorf("kept %q, want %s once confirmed", got, tc.ns.Path)
			}
		})
	}
}

// TestSearchMinAge: a namespace that existed just over the minimum age
// before the first start is found; one just under is not.
func TestSearchMinAge(t *testing.T) {
	for _, tc := range []struct {
		age   time.Duration
		found bool
	}{{time.Second, true}, {-time.Second, false}} {
		w, pod := newOldPodWorld(t)
		w.target.namespaces[0].ExistsSince = w.s.Reports.ChainedSince().Add(-w.s.Config.NetnsSearchMinAge - tc.age)
		t0 := time.Now()
		w.step(t0)
		w.step(t0.Add(searchConfirm))
		if found := w.kept(pod) != ""; found != tc.found {
			t.Errorf("existing %v beyond the minimum age: found %v, want %v (%s)", tc.age, found, tc.found, w.reason(pod))
		}
	}
}

// TestSearchRefuses: no namespace is chosen when nothing may be: several
// hold the addresses, one holds more, another pod shows one of them, a
// report names the one, or an entry (or a report's path) is not read.
func TestSearchRefuses(t *testing.T) {
	t0 := time.Now()
	for _, tc := range []struct {
		name  string
		setup func(w *searchWorld)
		want  error
	}{
		{"two namespaces", func(w *searchWorld) { w.addNamespace("/run/netns/cni-dead", 2, "10.0.1.50") }, ErrNetnsAmbiguous},
		{"more addresses", func(w *searchWorld) {
			w.target.namespaces[0].IPs = append(w.target.namespaces[0].IPs, netip.MustParseAddr("10.0.1.99"))
		}, ErrNetnsNotFound},
		{"address shown for another pod", func(w *searchWorld) { w.addPod("stale", false, "10.0.1.50") }, ErrAddressShared},
		{"reported for another pod", func(w *searchWorld) {
			w.report(&tables.CNIPod{ContainerID: "c-new", Pod: "app/new", UID: "new-1", Netns: "/var/run/netns/alias-of-cni-old"})
			w.target.aliases = map[string]NetnsID{"/var/run/netns/alias-of-cni-old": {Ino: 1}}
		}, ErrNetnsReported},
		{"a younger namespace holds them too", func(w *searchWorld) {
			w.addNamespace("/run/netns/cni-young", 2, "10.0.1.50")
			w.target.namespaces[1].ExistsSince = w.s.Reports.ChainedSince()
		}, ErrNetnsAmbiguous},
		{"an entry not read", func(w *searchWorld) { w.target.errs["/run/netns/cni-x"] = os.ErrPermission }, ErrNetnsUnreadable},
		{"younger than the first start less the minimum age", func(w *searchWorld) {
			w.target.namespaces[0].ExistsSince = w.s.Reports.ChainedSince().Add(-w.s.Config.NetnsSearchMinAge + time.Second)
		}, ErrNetnsTooNew},
		{"Cilium's health endpoint", func(w *searchWorld) { w.target.namespaces[0].Path = "/run/netns/cilium-health" }, ErrNetnsNotPod},
		{"the first start unknown", func(w *searchWorld) { w.s.Reports = tableReportsOf{w.db, w.cniPods, time.Time{}} }, ErrFirstStartUnknown},
		{"a report's path not read", func(w *searchWorld) {
			w.report(&tables.CNIPod{ContainerID: "c-x", Pod: "app/x", UID: "x-1", Netns: "/proc/4242/ns/net"})
			w.target.identifyErr = os.ErrPermission
		}, ErrNetnsUnreadable},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w, pod := newOldPodWorld(t)
			tc.setup(w)
			for _, at := range []time.Duration{0, searchConfirm} {
				w.step(t0.Add(at))
			}
			if got := w.kept(pod); got != "" || !strings.Contains(w.reason(pod), tc.want.Error()) {
				t.Errorf("kept %q, reason %q; want none, %v", got, w.reason(pod), tc.want)
			}
			if err := w.s.notFound(); err == nil || !strings.Contains(err.Error(), "app/old: ") {
				t.Errorf("health: %v, want app/old named", err)
			}
		})
	}
}

// TestSearchRechecksAtKeep: what changes between the listing and the keep
// stops the keep: a report naming the namespace, the pod's own sandbox
// reported, the pod unenrolled, its addresses shown for another pod.
func TestSearchRechecksAtKeep(t *testing.T) {
	for _, tc := range []struct {
		name   string
		change func(w *searchWorld)
		reason string
	}{
		{"another pod's report names it", func(w *searchWorld) {
			w.report(&tables.CNIPod{ContainerID: "c-new", Pod: "app/new", UID: "new-1", Netns: "/run/netns/cni-old"})
		}, "named by a report of app/new"},
		{"its sandbox reported", func(w *searchWorld) {
			w.report(&tables.CNIPod{ContainerID: "c-old", Pod: "app/old", UID: "old-1", Netns: "/var/run/netns/cni-new"})
		}, "reported meanwhile"},
		{"unenrolled", func(w *searchWorld) { w.addPod("old", false, "10.0.1.50") }, "no longer enrolled"},
		{"address shown for another pod", func(w *searchWorld) { w.addPod("newcomer", false, "10.0.1.50") }, ErrAddressShared.Error()},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w, pod := newOldPodWorld(t)
			t0 := time.Now()
			w.step(t0)
			// The change lands while the folder is listed, after the
			// step's snapshot.
			w.target.onSearch = func() { tc.change(w) }
			w.step(t0.Add(searchConfirm))
			if got := w.kept(pod); got != "" || !strings.Contains(w.reason(pod), tc.reason) {
				t.Errorf("kept %q, reason %q; want none, %q", got, w.reason(pod), tc.reason)
			}
		})
	}
}

// TestSearchDropsWhatItKept: a namespace kept is dropped at the next
// check once it is gone, holds other addresses, or the pod's sandbox (or
// another pod naming it) is reported; kept otherwise.
func TestSearchDropsWhatItKept(t *testing.T) {
	t0 := time.Now()
	for _, tc := range []struct {
		name   string
		change func(w *searchWorld)
		drop   bool
	}{
		{"nothing changed", func(*searchWorld) {}, false},
		{"an entry not read", func(w *searchWorld) {
			w.target.errs["/run/netns/cni-old"] = os.ErrPermission
			w.target.unlisted = true
		}, false},
		{"the folder not read", func(w *searchWorld) {
			w.target.errs["/run/netns"] = os.ErrPermission
			w.target.unlisted = true
		}, false},
		{"listed under another folder", func(w *searchWorld) { w.s.Config.NetnsDir = "/var/run/netns" }, false},
		{"the folder, named with a trailing slash, not read", func(w *searchWorld) {
			w.s.Config.NetnsDir = "/run/netns/"
			w.target.errs["/run/netns"] = os.ErrPermission
			w.target.unlisted = true
		}, false},
		{"no namespace any more, another entry not read", func(w *searchWorld) {
			w.target.errs["/run/netns/cni-x"] = os.ErrPermission
			w.target.unlisted = true
		}, true},
		{"no namespace any more", func(w *searchWorld) {
			w.target.unlisted = true // the path is a file now (Identify still finds it)
		}, true},
		{"address shown for another pod", func(w *searchWorld) { w.addPod("newcomer", false, "10.0.1.50") }, true},
		{"namespace gone", func(w *searchWorld) { w.target.namespaces = nil }, true},
		{"other addresses", func(w *searchWorld) { w.target.namespaces[0].IPs = []netip.Addr{netip.MustParseAddr("10.0.1.51")} }, true},
		{"sandbox reported", func(w *searchWorld) {
			w.report(&tables.CNIPod{ContainerID: "c-old", Pod: "app/old", UID: "old-1", Netns: "/var/run/netns/cni-new"})
		}, true},
		{"another pod's report names it", func(w *searchWorld) {
			w.report(&tables.CNIPod{ContainerID: "c-new", Pod: "app/new", UID: "new-1", Netns: "/run/netns/cni-old"})
		}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w, pod := newOldPodWorld(t)
			w.step(t0)
			w.step(t0.Add(searchConfirm))
			if w.kept(pod) == "" {
				t.Fatal("not kept")
			}
			tc.change(w)
			next := w.step(t0.Add(searchConfirm + searchRetry/2))
			if w.kept(pod) == "" {
				t.Fatal("dropped before the check is due")
			}
			w.step(next)
			if dropped := w.kept(pod) == ""; dropped != tc.drop {
				t.Errorf("dropped %v, want %v", dropped, tc.drop)
			}
		})
	}
}

// TestSearchMinAgeNotNegative: a negative minimum age is refused at start.
func TestSearchMinAgeNotNegative(t *testing.T) {
	if err := registerSearch(searchParams{Config: Config{NetnsSearchMinAge: -time.Second}}); err == nil {
		t.Errorf("--netns-search-min-age=-1s accepted")
	}
}

// TestMatchNamespace: the one namespace holding exactly the addresses
// (loopback and link-local aside), a namespace pinned twice counting once.
func TestMatchNamespace(t *testing.T) {
	a4, a6, b4 := netip.MustParseAddr("10.0.1.1"), netip.MustParseAddr("fd00::1"), netip.MustParseAddr("10.0.1.2")
	lo, ll := netip.MustParseAddr("127.0.0.1"), netip.MustParseAddr("fe80::1")
	dual := Namespace{Path: "/n/dual", ID: NetnsID{Ino: 1}, IPs: []netip.Addr{lo, a6, ll, a4}}
	pinnedAgain := Namespace{Path: "/n/again", ID: NetnsID{Ino: 1}, IPs: dual.IPs}
	v4only := Namespace{Path: "/n/v4", ID: NetnsID{Ino: 2}, IPs: []netip.Addr{a4}}
	other := Namespace{Path: "/n/other", ID: NetnsID{Ino: 3}, IPs: []netip.Addr{b4}}
	for _, tc := range []struct {
		ips        []netip.Addr
		namespaces []Namespace
		want       string
		err        error
	}{
		{[]netip.Addr{a4, a6}, []Namespace{other, v4only, dual, pinnedAgain}, "/n/dual", nil},
		{[]netip.Addr{a4}, []Namespace{other, v4only, dual}, "/n/v4", nil},
		{[]netip.Addr{a4}, []Namespace{v4only, {Path: "/n/v4-dead", ID: NetnsID{Ino: 4}, IPs: []netip.Addr{a4}}}, "", ErrNetnsAmbiguous},
		{[]netip.Addr{a6, b4}, []Namespace{other, dual}, "", ErrNetnsNotFound},
		{[]netip.Addr{a4}, nil, "", ErrNetnsNotFound},
	} {
		got, err := matchNamespace(tc.ips, tc.namespaces)
		if got.Path != tc.want || !errors.Is(err, tc.err) {
			t.Errorf("%v: got %q, %v; want %q, %v", tc.ips, got.Path, err, tc.want, tc.err)
		}
	}
}

// searchTarget lists namespaces from memory and counts the listings.
type searchTarget struct {
	Target
	namespaces []Namespace
	// unlisted: the listing leaves the namespaces out (they exist).
	unlisted    bool
	errs        map[string]error
	aliases     map[string]NetnsID
	identifyErr error
	onSearch    func()
	searches    int
}

func (s *searchTarget) Namespaces(dir string) ([]Namespace, map[string]error) {
	s.searches++
	if s.onSearch != nil {
		s.onSearch()
	}
	var listed []Namespace
	for _, ns := range s.namespaces {
		if filepath.Dir(ns.Path) == filepath.Clean(dir) && !s.unlisted {
			listed = append(listed, ns)
		}
	}
	return listed, s.errs
}

func (s *searchTarget) Identify(path string) (NetnsID, error) {
	if id, ok := s.aliases[path]; ok {
		return id, nil
	}
	for _, ns := range s.namespaces {
		if ns.Path == path {
			return ns.ID, nil
		}
	}
	if s.identifyErr != nil {
		return NetnsID{}, s.identifyErr
	}
	return NetnsID{}, os.ErrNotExist
}

// tableReportsOf keeps rows in the table only; the agent started at
// since.
type tableReportsOf struct {
	db      *statedb.DB
	cniPods statedb.RWTable[*tables.CNIPod]
	since   time.Time
}

func (r tableReportsOf) ChainedSince() time.Time { return r.since }

func (r tableReportsOf) Keep(row *tables.CNIPod, check func(statedb.ReadTxn) error) error {
	wtxn := r.db.WriteTxn(r.cniPods)
	defer wtxn.Abort()
	if check != nil {
		if err := check(wtxn); err != nil {
			return err
		}
	}
	r.cniPods.Insert(wtxn, row)
	wtxn.Commit()
	return nil
}

func (r tableReportsOf) Drop(row *tables.CNIPod) error {
	wtxn := r.db.WriteTxn(r.cniPods)
	r.cniPods.Delete(wtxn, row)
	wtxn.Commit()
	return nil
}
