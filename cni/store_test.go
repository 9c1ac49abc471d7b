// SPDX-License-Identifier: Apache-2.0

package cni

import (
	"errors"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/statedb"

	"github.com/mtlsbridge/mtlsbridge/tables"
)

func TestStore(t *testing.T) {
	s := newStore(t.TempDir())
	if rows, errs := s.load(); len(rows) != 0 || len(errs) != 0 {
		t.Fatalf("empty folder: %v %v", rows, errs)
	}
	web := &tables.CNIPod{ContainerID: "c1", Pod: "app/web", UID: "u1", IPs: []netip.Addr{netip.MustParseAddr("10.0.1.40")},
		State: tables.CNIStateWaiting, Updated: time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)}
	api := &tables.CNIPod{ContainerID: "c2", Pod: "app/api", State: tables.CNIStateAllowed}
	for _, row := range []*tables.CNIPod{web, api} {
		if err := s.save(row); err != nil {
			t.Fatal(err)
		}
	}
	// A second save replaces the file.
	web.State = tables.CNIStateAllowed
	if err := s.save(web); err != nil {
		t.Fatal(err)
	}
	// Damage: a file that does not parse, one that names another
	// container; both are reported, the good rows load.
	os.WriteFile(filepath.Join(s.dir, "bad.json"), []byte("{"), 0o600)
	os.WriteFile(filepath.Join(s.dir, "moved.json"), []byte(`{"containerID": "c9", "pod": "app/x"}`), 0o600)

	rows, errs := s.load()
	if len(rows) != 2 || len(errs) != 2 {
		t.Fatalf("rows %v, errors %v: want 2 and 2", rows, errs)
	}
	got := map[string]*tables.CNIPod{}
	for _, r := range rows {
		got[r.ContainerID] = r
	}
	if w := got["c1"]; w == nil || w.State != tables.CNIStateAllowed || w.UID != "u1" || len(w.IPs) != 1 || !w.Updated.Equal(web.Updated) {
		t.Fatalf("c1 came back as %+v", w)
	}
	if err := s.remove("c1"); err != nil {
		t.Fatal(err)
	}
	if err := s.remove("c1"); err != nil {
		t.Fatalf("second remove: %v", err)
	}
	if rows, _ := s.load(); len(rows) != 1 || rows[0].ContainerID != "c2" {
		t.Fatalf("after remove: %v", rows)
	}
}

func TestValidContainerID(t *testing.T) {
	for _, id := range []string{"c1", "0123abcdef", "pod_a.b-c", strings.Repeat("a", 255)} {
		if err := validContainerID(id); err != nil {
			t.Errorf("%q: %v", id, err)
		}
	}
	for _, id := range []string{"", "..", ".hidden", "a/b", "a b", "-x", strings.Repeat("a", 256)} {
		if err := validContainerID(id); err == nil {
			t.Errorf("%q accepted", id)
		}
	}
}

// A report's addresses are checked and put in one spelling before they
// reach the table (and the redirect map through it).
func TestPodAddrs(t *testing.T) {
	got, err := podAddrs([]netip.Addr{netip.MustParseAddr("::ffff:10.1.0.5"), netip.MustParseAddr("10.1.0.5"), netip.MustParseAddr("fd00:1::5")})
	if err != nil || !slices.Equal(got, []netip.Addr{netip.MustParseAddr("10.1.0.5"), netip.MustParseAddr("fd00:1::5")}) {
		t.Errorf("podAddrs = %v, %v", got, err)
	}
	for _, bad := range []string{"::", "127.0.0.1", "::ffff:0.0.0.0", "ff02::1"} {
		if _, err := podAddrs([]netip.Addr{netip.MustParseAddr(bad)}); !errors.Is(err, tables.ErrNotPodAddr) {
			t.Errorf("podAddrs(%s): %v, want ErrNotPodAddr", bad, err)
		}
	}
}

// Reports of pods the API never shows, or shows with another UID (forged
// by a caller of the socket), go once they are older than the grace.
func TestUnknownPodRows(t *testing.T) {
	db := statedb.New()
	pods, err := tables.NewPodsTable(db, tables.LocalNode{NodeName: "node-a"})
	must(t, err)
	cniPods, err := tables.NewCNIPodsTable(db)
	must(t, err)
	now := time.Now()
	old, fresh := now.Add(-time.Hour), now
	txn := db.WriteTxn(pods, cniPods)
	defer txn.Abort()
	pods.Insert(txn, &tables.Pod{Namespace: "app", Name: "web", UID: "u1"})
	for _, row := range []*tables.CNIPod{
		{ContainerID: "known", Pod: "app/web", UID: "u1", Updated: old},
		{ContainerID: "known-no-uid", Pod: "app/web", Updated: old},
		{ContainerID: "forged-uid", Pod: "app/web", UID: "u2", Updated: old},
		{ContainerID: "never-existed", Pod: "app/ghost", Updated: old},
		{ContainerID: "not-seen-yet", Pod: "app/new", Updated: fresh},
	} {
		cniPods.Insert(txn, row)
	}
	var got []string
	for _, row := range unknownPodRows(txn, pods, cniPods, now.Add(-unknownPodGrace)) {
		got = append(got, row.ContainerID)
	}
	slices.Sort(got)
	if want := []string{"forged-uid", "never-existed"}; !slices.Equal(got, want) {
		t.Errorf("swept %v, want %v", got, want)
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// TestReportsKeep: a row kept (a namespace the in-pod mode found) is on
// disk for the next agent and in the table, unless the check refuses it;
// a container id that cannot be a file name is not written on disk (a
// logged error), and still in the table; a row dropped leaves both.
func TestReportsKeep(t *testing.T) {
	db := statedb.New()
	cniPods, err := tables.NewCNIPodsTable(db)
	if err != nil {
		t.Fatal(err)
	}
	s := newStore(t.TempDir())
	r := reports{log: slog.New(slog.DiscardHandler), db: db, cniPods: cniPods, store: s}
	found := &tables.CNIPod{ContainerID: "found-0123456789abcdef", Pod: "app/old", UID: "u1", Netns: "/var/run/netns/cni-1",
		State: tables.CNIStateFound, Enrolled: true}
	refused := errors.New("reported meanwhile")
	if err := r.Keep(found, func(statedb.ReadTxn) error { return refused }); err != refused {
		t.Fatalf("refused by its check: %v", err)
	}
	if rows, _ := s.load(); len(rows) != 0 || cniPods.NumObjects(db.ReadTxn()) != 0 {
		t.Fatalf("a row its check refused was written: %v", rows)
	}
	if err := r.Keep(found, func(statedb.ReadTxn) error { return nil }); err != nil {
		t.Fatal(err)
	}
	if rows, errs := s.load(); len(errs) != 0 || len(rows) != 1 || rows[0].Netns != found.Netns || rows[0].State != tables.CNIStateFound {
		t.Errorf("on disk: %v %v, want the row found", rows, errs)
	}
	bad := &tables.CNIPod{ContainerID: "../escape", Pod: "app/x"}
	if err := r.Keep(bad, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(s.dir, "..", "escape.json")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a file outside the store: %v", err)
	}
	txn := db.ReadTxn()
	for _, id := range []string{found.ContainerID, bad.ContainerID} {
		if _, _, ok := cniPods.Get(txn, tables.CNIPodByContainer(id)); !ok {
			t.Errorf("%s not in the table", id)
		}
	}
	for _, row := range []*tables.CNIPod{found, bad} {
		if err := r.Drop(row); err != nil {
			t.Fatal(err)
		}
	}
	if rows, _ := s.load(); len(rows) != 0 || cniPods.NumObjects(db.ReadTxn()) != 0 {
		t.Errorf("after Drop: on disk %v, %d rows", rows, cniPods.NumObjects(db.ReadTxn()))
	}
}

// TestFirstStart: the first start of this boot is recorded once and read
// back by later agents of the same boot; a record of an earlier boot is
// replaced; one that does not read gives the zero record (nothing
// precedes it), never a later start.
func TestFirstStart(t *testing.T) {
	s := newStore(t.TempDir())
	first := FirstStart{At: time.Date(2026, 12, 6, 1, 0, 0, 0, time.UTC), BootID: "boot-1", BootTime: time.Minute}
	if got, err := s.firstStart(first); err != nil || got != first {
		t.Fatalf("first agent: %v %v", got, err)
	}
	restart := FirstStart{At: first.At.Add(time.Hour), BootID: "boot-1", BootTime: time.Hour + time.Minute}
	if got, err := s.firstStart(restart); err != nil || !got.At.Equal(first.At) {
		t.Errorf("a restarted agent: %v %v, want the first start", got, err)
	}
	if rows, errs := s.load(); len(rows) != 0 || len(errs) != 0 {
		t.Errorf("the record is read as a report: %v %v", rows, errs)
	}
	rebooted := FirstStart{At: first.At.Add(2 * time.Hour), BootID: "boot-2", BootTime: time.Second}
	if got, err := s.firstStart(rebooted); err != nil || got != rebooted {
		t.Errorf("after a reboot the folder kept: %v %v, want the new start", got, err)
	}
	must(t, os.WriteFile(filepath.Join(s.dir, firstStartFile), []byte("garbled"), 0o600))
	if got, err := s.firstStart(FirstStart{At: first.At.Add(3 * time.Hour), BootID: "boot-2"}); err == nil || !got.At.IsZero() {
		t.Errorf("after a garbled record: %v %v, want an error and no start", got, err)
	}
}

// TestFirstStartSince: a wall clock set back after the first start moves
// it back as much; one set forward leaves it.
func TestFirstStartSince(t *testing.T) {
	at := time.Date(2026, 12, 6, 1, 0, 0, 0, time.UTC)
	f := FirstStart{At: at, BootID: "b", BootTime: time.Minute}
	for _, tc := range []struct {
		name     string
		now      time.Time
		bootTime time.Duration
		want     time.Time
	}{
		{"clock kept", at.Add(time.Hour), time.Hour + time.Minute, at},
		{"set back 2h", at.Add(time.Hour - 2*time.Hour), time.Hour + time.Minute, at.Add(-2 * time.Hour)},
		{"set forward 2h", at.Add(3 * time.Hour), time.Hour + time.Minute, at},
	} {
		if got := f.Since(tc.now, tc.bootTime); !got.Equal(tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
	if got := (FirstStart{}).Since(at, time.Minute); !got.IsZero() {
		t.Errorf("unknown first start: %v, want zero", got)
	}
}

// TestStartNow: the record of a start carries no monotonic reading (a
// step of the wall clock must show in Since, also in the agent that
// wrote it), and the boot's id.
func TestStartNow(t *testing.T) {
	now, err := startNow()
	if err != nil {
		t.Fatal(err)
	}
	if now.At != now.At.Round(0) || now.BootID == "" || now.BootTime <= 0 {
		t.Errorf("start %+v: want a wall-clock time, the boot id and CLOCK_BOOTTIME", now)
	}
	// The same process, its clock set back 2h: seen.
	if got := now.Since(now.At.Add(-2*time.Hour+time.Second), now.BootTime+time.Second); !got.Equal(now.At.Add(-2 * time.Hour)) {
		t.Errorf("set back 2h: %v, want %v", got, now.At.Add(-2*time.Hour))
	}
}

// TestChainedBeforeBoot: a plugin binary older than the boot means the
// plugin was chained before it; a newer or missing one does not.
func TestChainedBeforeBoot(t *testing.T) {
	dir := t.TempDir()
	start := FirstStart{At: time.Now(), BootID: "b", BootTime: time.Hour}
	if chainedBeforeBoot(dir, start) {
		t.Errorf("no binary: chained before boot")
	}
	bin := filepath.Join(dir, "mtlsbridge-cni")
	must(t, os.WriteFile(bin, nil, 0o755))
	if chainedBeforeBoot(dir, start) {
		t.Errorf("a binary of this boot: chained before boot")
	}
	must(t, os.Chtimes(bin, time.Time{}, start.At.Add(-2*time.Hour)))
	if !chainedBeforeBoot(dir, start) {
		t.Errorf("a binary older than the boot: not chained before boot")
	}
}

// TestNewReportsChainedBeforeBoot: with --cni-install and a plugin binary
// older than the boot, the boot itself is recorded as the first start;
// without the install, or with a binary of this boot, the agent's start.
func TestNewReportsChainedBeforeBoot(t *testing.T) {
	now, err := startNow()
	must(t, err)
	boot := now.At.Add(-now.BootTime)
	for _, tc := range []struct {
		name         string
		install, old bool
		wantBoot     bool
	}{
		{"installed before the boot", true, true, true},
		{"installed this boot", true, false, false},
		{"not installed by the agent", false, true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			binDir := t.TempDir()
			bin := filepath.Join(binDir, "mtlsbridge-cni")
			must(t, os.WriteFile(bin, nil, 0o755))
			if tc.old {
				must(t, os.Chtimes(bin, time.Time{}, boot.Add(-time.Hour)))
			}
			db := statedb.New()
			cniPods, err := tables.NewCNIPodsTable(db)
			must(t, err)
			r := newReports(Config{CNIInstall: tc.install, CNIBinDir: binDir}, slog.New(slog.DiscardHandler), db, cniPods, newStore(t.TempDir()))
			// Within a second of the boot, or of now.
			got := r.ChainedSince()
			if atBoot := got.Sub(boot).Abs() < time.Second; atBoot != tc.wantBoot {
				t.Errorf("first start %v (boot %v, now %v): at the boot %v, want %v", got, boot, now.At, atBoot, tc.wantBoot)
			}
		})
	}
}
