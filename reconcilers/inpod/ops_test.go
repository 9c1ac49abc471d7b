// SPDX-License-Identifier: Apache-2.0

package inpod

import (
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"log/slog"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/statedb"

	"github.com/mtlsbridge/mtlsbridge/internal/netnstest"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// TestPruneNamesWhatItCannotRead: a namespace the prune cannot read is
// named in its error (the reconciler logs it and counts it in its prune
// errors) instead of being passed over in silence; the other namespaces
// are pruned all the same.
func TestPruneNamesWhatItCannotRead(t *testing.T) {
	target := &pruneTarget{present: map[string]bool{"/run/netns/stale": true, "/run/netns/clean": false}, unreadable: "/run/netns/unreadable"}
	ops, txn := pruneWorld(t, target, []string{"/run/netns/stale", "/run/netns/unreadable", "/run/netns/clean"}, nil, nil)
	err := ops.Prune(context.Background(), txn, ops.redirections.All(txn))
	if err == nil || !strings.Contains(err.Error(), "netns /run/netns/unreadable: permission denied") {
		t.Errorf("prune error %v, want one naming the unreadable namespace", err)
	}
	if !slices.Equal(target.removed, []string{"/run/netns/stale"}) {
		t.Errorf("removed %v, want the stale namespace's redirection only", target.removed)
	}
}

// TestPruneLeavesPodsThatLeft: a namespace whose report names a pod the
// API no longer shows (deleted by force while no agent ran, its report
// not yet dropped) keeps its redirection; it goes with the namespace.
func TestPruneLeavesPodsThatLeft(t *testing.T) {
	target := &pruneTarget{present: map[string]bool{"/run/netns/stale": true, "/run/netns/left": true}}
	ops, txn := pruneWorld(t, target, []string{"/run/netns/stale"}, []string{"/run/netns/left"}, nil)
	must(t, ops.Prune(context.Background(), txn, ops.redirections.All(txn)))
	if !slices.Equal(target.removed, []string{"/run/netns/stale"}) {
		t.Errorf("removed %v, want the stale namespace's redirection only", target.removed)
	}
}

// TestRowsTheAgentCannotIdentify: a row whose namespace path the agent
// cannot read (stat fails) is named in the prune's error, once, and its
// path is left alone; the rest is pruned, and other pods' rows are
// removed, all the same. A removal whose namespace is gone does nothing,
// without error, nor does one of a pod the API no longer shows (a forced
// deletion: its sandbox may run on, and its rules go with its namespace),
// even when a pod of its name was created since.
func TestRowsTheAgentCannotIdentify(t *testing.T) {
	x := &Redirection{Pod: "app/x", Netns: "/proc/77/ns/net"}
	target := &pruneTarget{present: map[string]bool{"/run/netns/stale": true, "/run/netns/y": true, "/run/netns/forced": true, "/run/netns/sts-0": true}, unidentified: x.Netns}
	ops, txn := pruneWorld(t, target, []string{x.Netns, "/run/netns/stale"}, nil, []string{"app/y", "app/gone", "app/sts-0@uid-2"}, x)
	ctx := context.Background()
	err := ops.Prune(ctx, txn, ops.redirections.All(txn))
	if err == nil || err.Error() != "netns /proc/77/ns/net of pod app/x: permission denied" {
		t.Errorf("prune error %v, want one naming the row it cannot identify, once", err)
	}
	if !slices.Equal(target.removed, []string{"/run/netns/stale"}) {
		t.Fatalf("prune removed %v, want the stale namespace's redirection only", target.removed)
	}
	target.removed = nil
	must(t, ops.Delete(ctx, txn, 0, &Redirection{Pod: "app/y", Netns: "/run/netns/y"}))
	must(t, ops.Delete(ctx, txn, 0, &Redirection{Pod: "app/gone", Netns: "/run/netns/gone"}))
	must(t, ops.Delete(ctx, txn, 0, &Redirection{Pod: "app/forced", Netns: "/run/netns/forced"}))
	must(t, ops.Delete(ctx, txn, 0, &Redirection{Pod: "app/sts-0", UID: "uid-1", Netns: "/run/netns/sts-0"}))
	if !slices.Equal(target.removed, []string{"/run/netns/y"}) {
		t.Errorf("removed %v, want y's redirection only (gone's namespace is gone, forced left the API, sts-0 was recreated)", target.removed)
	}
}

// TestPresentFindsNothingWhereNothingCanBe: a namespace that is gone, the
// agent's own, and a path that is no network namespace hold nothing of the
// redirection, and are no error of the prune.
func TestPresentFindsNothingWhereNothingCanBe(t *testing.T) {
	target := netlinkTarget{}
	// A path that is gone, or can name nothing, is gone to the prune: it
	// is no candidate.
	for _, path := range []string{"/run/netns/none-such", "/etc/hostname/net"} {
		if _, err := target.Identify(path); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("identify %s: %v, want one wrapping os.ErrNotExist", path, err)
		}
	}
	for _, path := range []string{"/run/netns/none-such", "/proc/thread-self/ns/net", "/proc/self/ns/uts"} {
		id, _ := target.Identify(path)
		if present, err := target.Present(path, id); present || err != nil {
			t.Errorf("%s: present %v, error %v; want nothing there", path, present, err)
		}
	}
}

// TestStalePathNamesAnotherPod: the path of a CNI report may name another
// namespace later (/proc/PID/ns/net once the PID is reused; here a symlink
// pointed elsewhere). Neither the prune nor the removal of the stale pod's
// row touches the redirection of a pod whose row asks for the namespace
// the path names now; a namespace no row asks for still loses it. Real
// namespaces, real rules.
func TestStalePathNamesAnotherPod(t *testing.T) {
	netnstest.RequirePrivileged(t)
	n1, _ := netnstest.NewNodes(t)
	a, b := n1.AddPod(t, "a"), n1.AddPod(t, "b")
	pathA, pathB := "/var/run/netns/"+a.NS.Name, "/var/run/netns/"+b.NS.Name
	stale := filepath.Join(t.TempDir(), "net")
	pointAt := func(path string) {
		t.Helper()
		os.Remove(stale)
		must(t, os.Symlink(path, stale))
	}
	target := netlinkTarget{}
	// A process's /proc/PID/ns/net, the path cri-dockerd reports, and the
	// bind mount of /var/run/netns name one namespace alike.
	var sleeper *exec.Cmd
	must(t, a.Do(func() error {
		sleeper = exec.Command("sleep", "60")
		return sleeper.Start()
	}))
	t.Cleanup(func() { sleeper.Process.Kill(); sleeper.Wait() })
	byMount, err := target.Identify(pathA)
	must(t, err)
	byPID, err := target.Identify(fmt.Sprintf("/proc/%d/ns/net", sleeper.Process.Pid))
	must(t, err)
	if byMount != byPID {
		t.Fatalf("a's namespace: %v by its mount, %v by a process in it", byMount, byPID)
	}
	present := func(p *netnstest.Pod) bool {
		t.Helper()
		ok, err := rulesPresent(p.Handle)
		must(t, err)
		return ok
	}
	rowA := &Redirection{Pod: "app/a", Netns: pathA, IPs: []netip.Addr{a.IP4, a.IP6}}
	apply := func(r *Redirection) {
		t.Helper()
		_, err := target.Apply(r)
		must(t, err)
	}
	apply(rowA)
	apply(&Redirection{Pod: "app/b", Netns: pathB, IPs: []netip.Addr{b.IP4, b.IP6}})

	ops, txn := pruneWorld(t, target, []string{pathA, stale}, nil, []string{"app/a", "app/old"}, rowA)
	ctx := context.Background()
	oldRow := &Redirection{Pod: "app/old", Netns: stale}

	// neitherTakesA: the prune, and the removal of the stale row, leave
	// a's redirection alone.
	neitherTakesA := func(while string) {
		t.Helper()
		must(t, ops.Prune(ctx, txn, ops.redirections.All(txn)))
		if !present(a) {
			t.Fatalf("the prune removed a's redirection through a stale path that names a's namespace, while %s", while)
		}
		must(t, ops.Delete(ctx, txn, 0, oldRow))
		if !present(a) {
			t.Fatalf("removing a stale row's redirection removed a's, whose namespace the stale path names, while %s", while)
		}
	}

	pointAt(pathA)
	neitherTakesA("a's row asks for it by its own path")

	pointAt(pathB)
	must(t, ops.Prune(ctx, txn, ops.redirections.All(txn)))
	if present(b) || !present(a) {
		t.Fatalf("prune through a stale path naming b's namespace, which no row asks for: b has rules %v (want none), a %v (want them)", present(b), present(a))
	}
	apply(&Redirection{Pod: "app/b", Netns: pathB, IPs: []netip.Addr{b.IP4, b.IP6}})
	must(t, ops.Delete(ctx, txn, 0, oldRow))
	if present(b) {
		t.Fatal("removing the stale row's redirection left it in the namespace its path names, which no row asks for")
	}

	// The target checks the namespace it opened: a path that names another
	// namespace than the one identified (the PID reused in between) is
	// left alone.
	idB, err := target.Identify(pathB)
	must(t, err)
	pointAt(pathA)
	if ok, err := target.Present(stale, idB); ok || err != nil {
		t.Errorf("present through a path that names another namespace now: %v %v, want false", ok, err)
	}
	must(t, target.Remove(stale, idB))
	if !present(a) {
		t.Error("removal through a path that names another namespace now removed that namespace's redirection")
	}

	// A row whose path names nothing now (the process it named died, the
	// namespace lives on) still asks for the namespace its redirection was
	// written into.
	own := filepath.Join(t.TempDir(), "own")
	must(t, os.Symlink(pathA, own))
	rowOwn := &Redirection{Pod: "app/a", Netns: own, IPs: []netip.Addr{a.IP4, a.IP6}}
	ops, txn = pruneWorld(t, target, []string{own, stale}, nil, []string{"app/a", "app/old"}, rowOwn)
	must(t, ops.Update(ctx, txn, 0, rowOwn))
	must(t, os.Remove(own))
	neitherTakesA("a's own path names nothing")
}

// pruneTarget is namespaces by path, each its own (or none: gone), a
// path Identify cannot read, and a path Present cannot read; it records
// Remove. The prune and Delete call nothing else.
type pruneTarget struct {
	Target
	present      map[string]bool
	unidentified string
	unreadable   string
	removed      []string
}

func (p *pruneTarget) Identify(path string) (NetnsID, error) {
	switch _, exists := p.present[path]; {
	case path == p.unidentified:
		return NetnsID{}, errors.New("permission denied")
	case !exists && path != p.unreadable:
		return NetnsID{}, os.ErrNotExist
	}
	return NetnsID{Ino: uint64(crc32.ChecksumIEEE([]byte(path)))}, nil
}

func (p *pruneTarget) Present(path string, _ NetnsID) (bool, error) {
	if path == p.unreadable {
		return false, errors.New("permission denied")
	}
	return p.present[path], nil
}

func (p *pruneTarget) Remove(path string, _ NetnsID) error {
	p.removed = append(p.removed, path)
	return nil
}

// pruneWorld is what RulesOps reads: CNI reports of paths, of pods the API
// shows (reported) or no longer shows (left), other pods the API shows
// ("namespace/name", or "namespace/name@uid"), and rows.
func pruneWorld(t *testing.T, target Target, reported, left, inAPI []string, rows ...*Redirection) (*RulesOps, statedb.ReadTxn) {
	db := statedb.New()
	pods, err := tables.NewPodsTable(db, tables.LocalNode{NodeName: "node-a"})
	must(t, err)
	cniPods, err := tables.NewCNIPodsTable(db)
	must(t, err)
	redirections, err := NewRedirectionsTable(db)
	must(t, err)
	wtxn := db.WriteTxn(pods, cniPods, redirections)
	for _, key := range inAPI {
		key, uid, _ := strings.Cut(key, "@")
		ns, name, _ := strings.Cut(key, "/")
		_, _, err := pods.Insert(wtxn, &tables.Pod{Namespace: ns, Name: name, UID: uid})
		must(t, err)
	}
	for i, path := range reported {
		_, _, err := pods.Insert(wtxn, &tables.Pod{Namespace: "app", Name: fmt.Sprint("p", i)})
		must(t, err)
		_, _, err = cniPods.Insert(wtxn, &tables.CNIPod{ContainerID: fmt.Sprint("sandbox-", i), Pod: fmt.Sprint("app/p", i), Netns: path})
		must(t, err)
	}
	for i, path := range left {
		_, _, err := cniPods.Insert(wtxn, &tables.CNIPod{ContainerID: fmt.Sprint("left-", i), Pod: fmt.Sprint("app/left", i), Netns: path})
		must(t, err)
	}
	for _, r := range rows {
		_, _, err := redirections.Insert(wtxn, r)
		must(t, err)
	}
	return &RulesOps{target: target, pods: pods, cniPods: cniPods, redirections: redirections,
		active: &inPodMode{}, log: slog.New(slog.DiscardHandler)}, wtxn.Commit()
}
