// SPDX-License-Identifier: Apache-2.0

package inpod

import (
	"errors"
	"net/netip"
	"os"
	"slices"
	"testing"

	"github.com/cilium/statedb"

	"github.com/mtlsbridge/mtlsbridge/zds/nodeagent"
)

// TestNamespaceIsNeverOpenedUnchecked: ztunnel gets a pod's namespace only
// when the pod's redirection names the same one, and then checked to hold
// the redirection's addresses. While the rows disagree (a new sandbox
// reported, one row derived before the other) nothing is opened.
func TestNamespaceIsNeverOpenedUnchecked(t *testing.T) {
	db := statedb.New()
	redirections, err := NewRedirectionsTable(db)
	must(t, err)
	target := &openTarget{}
	open := openChecked(db, redirections, target)
	ips := []netip.Addr{netip.MustParseAddr("10.0.0.7")}
	w := &nodeagent.Workload{Pod: "app/a", UID: "uid-a", Netns: "/run/netns/new"}

	setRedirection := func(r *Redirection) {
		wtxn := db.WriteTxn(redirections)
		_, _, err := redirections.Insert(wtxn, r)
		must(t, err)
		wtxn.Commit()
	}
	refused := func(why string) {
		t.Helper()
		if f, err := open(w); !errors.Is(err, ErrNetnsUnchecked) {
			t.Fatalf("%s: open = %v, %v; want %v", why, f, err, ErrNetnsUnchecked)
		}
		if len(target.opened) > 0 {
			t.Fatalf("%s: the target opened %v", why, target.opened)
		}
	}

	refused("no redirection row")
	setRedirection(&Redirection{Pod: "app/a", Netns: "/run/netns/old", IPs: ips})
	refused("the redirection names the old sandbox")

	setRedirection(&Redirection{Pod: "app/a", Netns: "/run/netns/new", IPs: ips})
	f, err := open(w)
	must(t, err)
	f.Close()
	if len(target.opened) != 1 || target.opened[0] != w.Netns || !slices.Equal(target.checked[0], ips) {
		t.Fatalf("opened %v checked for %v; want %s checked for %v", target.opened, target.checked, w.Netns, ips)
	}
}

// openTarget records what it opens, and for which addresses.
type openTarget struct {
	Target
	opened  []string
	checked [][]netip.Addr
}

func (o *openTarget) Open(path string, ips []netip.Addr) (*os.File, error) {
	o.opened = append(o.opened, path)
	o.checked = append(o.checked, ips)
	return os.Open(os.DevNull)
}
