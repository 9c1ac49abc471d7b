// SPDX-License-Identifier: Apache-2.0

package redirect_test

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"github.com/spf13/pflag"

	"github.com/mtlsbridge/mtlsbridge/bpf"
	"github.com/mtlsbridge/mtlsbridge/internal/netnstest"
	"github.com/mtlsbridge/mtlsbridge/metrics"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/enrollment"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/redirect"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/steering"
	"github.com/mtlsbridge/mtlsbridge/tables"
	"github.com/mtlsbridge/mtlsbridge/tables/ingest"
)

// TestOtherModeContributesNothing: an agent in another mode
// (--redirect-mode=inpod) loads no program and writes no entry, and
// releases what an l2 agent left pinned: a's TCP, steered to the mTLS
// agent before, goes directly again, and the map and links are gone.
func TestOtherModeContributesNothing(t *testing.T) {
	c := newCluster(t)
	c.write(t, manifest{enrollA: true, withAgent: true})
	first := c.startAgent(t)
	done := reconciler.StatusKindDone
	first.waitFor(t, "a steered", func(txn statedb.ReadTxn) bool {
		return first.redirectIs(txn, c.a.IP4, bpf.KindEnrolled, done) && first.redirectIs(txn, bpf.AgentKey, bpf.KindAgent, done) &&
			first.attachmentIs(txn, c.a.HostIf, done)
	})
	if got, err := c.a.Ask(netip.AddrPortFrom(c.r.IP4, 8080)); err != nil || got.Server != "agent" {
		t.Fatalf("in l2 mode, a -> r: %v %v, want the agent", got, err)
	}
	first.stop(t)

	root := filepath.Join(c.bpfRoot, "agent")
	var redirects statedb.Table[*redirect.Redirect]
	var db *statedb.DB
	h := hive.New(cell.SimpleHealthCell, job.Cell, statedb.Cell,
		metrics.Cell, tables.Cell, ingest.Cell, enrollment.Cell, steering.Cell, redirect.Cell,
		cell.Invoke(func(d *statedb.DB, r statedb.Table[*redirect.Redirect]) { db, redirects = d, r }))
	flags := pflag.NewFlagSet("", pflag.ContinueOnError)
	h.RegisterFlags(flags)
	must(t, flags.Parse([]string{"--source=dir:" + c.manifests, "--node-name=node-a", "--bpf-root=" + root,
		"--node-netns=/var/run/netns/" + c.node1.Name, "--devices=" + netnstest.UplinkName, "--redirect-mode=inpod"}))
	log := hivetest.Logger(t)
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	must(t, h.Start(log, ctx))
	t.Cleanup(func() { h.Stop(log, context.Background()) })

	deadline := time.Now().Add(waitTimeout)
	for {
		var mapErr error
		for _, pin := range bpf.MapPins(root) {
			if _, err := os.Stat(pin); !errors.Is(err, os.ErrNotExist) {
				mapErr = fmt.Errorf("%s: %v", pin, err)
			}
		}
		links, _ := os.ReadDir(filepath.Join(root, "links"))
		if mapErr == nil && len(links) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the l2 pins are still there: map %v, links %v", mapErr, links)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if got, err := c.a.Ask(netip.AddrPortFrom(c.r.IP4, 8080)); err != nil || got.Server != "r" {
		t.Errorf("in the in-pod mode, a -> r: %v %v, want r directly", got, err)
	}
	if n := redirects.NumObjects(db.ReadTxn()); n != 0 {
		t.Errorf("%d redirects in another mode", n)
	}
	if ok, _ := redirects.Initialized(db.ReadTxn()); !ok {
		t.Error("redirects not initialized in another mode: readiness would wait forever")
	}
}
