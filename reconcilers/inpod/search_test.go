// SPDX-License-Identifier: Apache-2.0

package inpod

import (
	"errors"
	"log/slog"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/cilium/statedb"

	"github.com/mtlsbridge/mtlsbridge/tables"
)

// TestSearchWhen: a pod never reported is searched for at once; one whose
// report went while the agent watched only after searchSettle (its dying
// namespace still holds its addresses); one not found again after
// searchRetry, or at once when its addresses change; one found is kept as
// a report and searched no more.
func TestSearchWhen(t *testing.T) {
	db := statedb.New()
	cniPods, err := tables.NewCNIPodsTable(db)
	if err != nil {
		t.Fatal(err)
	}
	target := &searchTarget{}
	kept := &keptReports{}
	s := &search{
		searchParams: searchParams{Config: Config{NetnsDir: "/run/netns"}, Log: slog.New(slog.DiscardHandler), DB: db,
			Target: target, CNIPods: cniPods, Reports: kept},
		reported: map[string]bool{}, pending: map[string]*searchState{},
	}
	pod := func(name, ip string) *tables.Pod {
		return &tables.Pod{Namespace: "app", Name: name, UID: name + "-1", IPs: []netip.Addr{netip.MustParseAddr(ip)}}
	}
	step := func(now time.Time, reported []string, pods ...*tables.Pod) time.Time {
		set := map[string]bool{}
		for _, p := range reported {
			set[p] = true
		}
		return s.step(db.ReadTxn(), pods, set, now)
	}
	t0 := time.Now()

	// new has no report from the start: searched at once, not found.
	newPod := pod("new", "10.0.1.50")
	if next := step(t0, nil, newPod); target.searches != 1 || !next.Equal(t0.Add(searchRetry)) {
		t.Fatalf("first step: %d searches, next %v, want 1 and t0+%v", target.searches, next.Sub(t0), searchRetry)
	}
	if err := s.notFound(); err == nil || !strings.Contains(err.Error(), "app/new: "+ErrNetnsNotFound.Error()) {
		t.Errorf("notFound %v, want app/new's reason", err)
	}
	step(t0.Add(searchRetry/2), nil, newPod)
	if target.searches != 1 {
		t.Errorf("searched again before searchRetry")
	}
	// Its addresses change: searched at once.
	moved := pod("new", "10.0.1.51")
	step(t0.Add(searchRetry/2), nil, moved)
	if target.searches != 2 {
		t.Errorf("%d searches, want one more once the pod's addresses changed", target.searches)
	}

	// gone loses its report (a CNI DEL) while its namespace still holds
	// its addresses: not searched for searchSettle.
	target.namespaces = []Namespace{{Path: "/run/netns/dying", ID: NetnsID{Ino: 1}, IPs: []netip.Addr{netip.MustParseAddr("10.0.1.60")}}}
	gone := pod("gone", "10.0.1.60")
	t1 := t0.Add(time.Minute)
	step(t1, []string{"app/gone"}, moved)
	before := target.searches
	if next := step(t1, nil, moved, gone); target.searches != before || !next.Equal(t1.Add(searchSettle)) {
		t.Fatalf("report gone: %d searches, next %v, want none and t1+%v", target.searches-before, next.Sub(t1), searchSettle)
	}
	if len(kept.rows) != 0 {
		t.Fatalf("kept %v before searchSettle", kept.rows)
	}
	// Later, its namespace still holds them (a sandbox that lives on):
	// found and kept.
	if next := step(t1.Add(searchSettle), nil, moved, gone); len(kept.rows) != 1 || next.Equal(t1.Add(searchSettle)) {
		t.Fatalf("after searchSettle: kept %v, next %v", kept.rows, next)
	}
	row := kept.rows[0]
	if row.Pod != "app/gone" || row.UID != "gone-1" || row.Netns != "/run/netns/dying" || row.State != tables.CNIStateFound {
		t.Errorf("kept %+v", row)
	}
	if _, pending := s.pending["app/gone"]; pending {
		t.Errorf("a pod found is still pending")
	}
}

// TestMatchNamespace: the one namespace holding every address, a
// namespace pinned twice counting once.
func TestMatchNamespace(t *testing.T) {
	a4, a6, b4 := netip.MustParseAddr("10.0.1.1"), netip.MustParseAddr("fd00::1"), netip.MustParseAddr("10.0.1.2")
	dual := Namespace{Path: "/n/dual", ID: NetnsID{Ino: 1}, IPs: []netip.Addr{a4, a6}}
	pinnedAgain := Namespace{Path: "/n/again", ID: NetnsID{Ino: 1}, IPs: []netip.Addr{a4, a6}}
	v4only := Namespace{Path: "/n/v4", ID: NetnsID{Ino: 2}, IPs: []netip.Addr{a4}}
	other := Namespace{Path: "/n/other", ID: NetnsID{Ino: 3}, IPs: []netip.Addr{b4}}
	for _, tc := range []struct {
		ips        []netip.Addr
		namespaces []Namespace
		want       string
		err        error
	}{
		{[]netip.Addr{a4, a6}, []Namespace{other, v4only, dual, pinnedAgain}, "/n/dual", nil},
		{[]netip.Addr{a4}, []Namespace{other, v4only}, "/n/v4", nil},
		{[]netip.Addr{a4}, []Namespace{v4only, dual}, "", ErrNetnsAmbiguous},
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
	searches   int
}

func (s *searchTarget) Namespaces(string) ([]Namespace, []error) {
	s.searches++
	return s.namespaces, nil
}

func (s *searchTarget) Identify(path string) (NetnsID, error) {
	for _, ns := range s.namespaces {
		if ns.Path == path {
			return ns.ID, nil
		}
	}
	return NetnsID{}, os.ErrNotExist
}

type keptReports struct{ rows []*tables.CNIPod }

func (k *keptReports) Keep(row *tables.CNIPod) error {
	k.rows = append(k.rows, row)
	return nil
}
