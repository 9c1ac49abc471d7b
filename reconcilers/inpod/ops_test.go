// SPDX-License-Identifier: Apache-2.0

package inpod

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/statedb"

	"github.com/mtlsbridge/mtlsbridge/tables"
)

// TestPruneNamesWhatItCannotRead: a namespace the prune cannot read is
// named in its error (the reconciler logs it and counts it in its prune
// errors) instead of being passed over in silence; the other namespaces
// are pruned all the same.
func TestPruneNamesWhatItCannotRead(t *testing.T) {
	db := statedb.New()
	cniPods, err := tables.NewCNIPodsTable(db)
	must(t, err)
	wtxn := db.WriteTxn(cniPods)
	for i, path := range []string{"/run/netns/stale", "/run/netns/unreadable", "/run/netns/clean"} {
		_, _, err := cniPods.Insert(wtxn, &tables.CNIPod{ContainerID: fmt.Sprint("sandbox-", i), Pod: fmt.Sprint("app/p", i), Netns: path})
		must(t, err)
	}
	txn := wtxn.Commit()

	target := &pruneTarget{present: map[string]bool{"/run/netns/stale": true}, unreadable: "/run/netns/unreadable"}
	ops := &RulesOps{target: target, cniPods: cniPods, log: slog.New(slog.DiscardHandler)}
	noRows := func(func(*Redirection, statedb.Revision) bool) {}
	err = ops.Prune(context.Background(), txn, noRows)
	if err == nil || !strings.Contains(err.Error(), "netns /run/netns/unreadable: permission denied") {
		t.Errorf("prune error %v, want one naming the unreadable namespace", err)
	}
	if !slices.Equal(target.removed, []string{"/run/netns/stale"}) {
		t.Errorf("removed %v, want the stale namespace's redirection only", target.removed)
	}
}

// TestPresentFindsNothingWhereNothingCanBe: a namespace that is gone, the
// agent's own, and a path that is no network namespace hold nothing of the
// redirection, and are no error of the prune.
func TestPresentFindsNothingWhereNothingCanBe(t *testing.T) {
	for _, path := range []string{"/run/netns/none-such", "/proc/thread-self/ns/net", "/proc/self/ns/uts"} {
		if present, err := newNetlinkTarget().Present(path); present || err != nil {
			t.Errorf("%s: present %v, error %v; want nothing there", path, present, err)
		}
	}
}

// pruneTarget answers Present from a map, fails it for one path, and
// records Remove; the prune calls nothing else.
type pruneTarget struct {
	Target
	present    map[string]bool
	unreadable string
	removed    []string
}

func (p *pruneTarget) Present(path string) (bool, error) {
	if path == p.unreadable {
		return false, errors.New("permission denied")
	}
	return p.present[path], nil
}

func (p *pruneTarget) Remove(path string) error {
	p.removed = append(p.removed, path)
	return nil
}
