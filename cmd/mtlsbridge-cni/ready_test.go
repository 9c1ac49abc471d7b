// SPDX-License-Identifier: Apache-2.0

package main_test

import (
	"context"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"github.com/spf13/pflag"

	"github.com/mtlsbridge/mtlsbridge/agent"
	"github.com/mtlsbridge/mtlsbridge/api"
	"github.com/mtlsbridge/mtlsbridge/api/client"
	"github.com/mtlsbridge/mtlsbridge/bpf"
	"github.com/mtlsbridge/mtlsbridge/cni"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/enrollment"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/redirect"
	"github.com/mtlsbridge/mtlsbridge/tables"
	"github.com/mtlsbridge/mtlsbridge/tables/ingest"
)

// TestReady: the path the whole agent cannot show without a datapath. The
// agent's cells, except the redirect module, whose redirects and
// attachments tables the test writes: an ADD waiting for an enrolled pod
// succeeds as soon as the rows of its addresses are done, and only for the
// addresses they cover.
func TestReady(t *testing.T) {
	manifests := t.TempDir()
	b, err := os.ReadFile("testdata/cluster.yaml")
	if err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(manifests, "cluster.yaml"), b, 0o644)
	stateDir, err := os.MkdirTemp("", "mtlsbridge-") // short: UNIX socket path
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(stateDir) })

	var (
		db          *statedb.DB
		redirects   statedb.RWTable[*redirect.Redirect]
		attachments statedb.RWTable[*redirect.Attachment]
		pods        statedb.Table[*tables.Pod]
	)
	h := hive.New(
		agent.Infrastructure,
		tables.Cell, ingest.Cell, enrollment.Cell, api.Cell,
		cell.Module("fake-redirect", "redirects and attachments written by the test",
			cell.Provide(
				redirect.NewRedirectsTable,
				redirect.NewAttachmentsTable,
				statedb.RWTable[*redirect.Redirect].ToTable,
				statedb.RWTable[*redirect.Attachment].ToTable,
				func() redirect.Datapath { return enabledDatapath{} },
				// The CNI route asks the l2 mode about these rows.
				redirect.NewL2Mode,
			),
		),
		cni.Cell,
		cell.Invoke(func(d *statedb.DB, r statedb.RWTable[*redirect.Redirect], a statedb.RWTable[*redirect.Attachment], p statedb.Table[*tables.Pod]) {
			db, redirects, attachments, pods = d, r, a, p
		}),
	)
	fs := pflag.NewFlagSet("", pflag.ContinueOnError)
	h.RegisterFlags(fs)
	if err := fs.Parse([]string{"--source=dir:" + manifests, "--state-dir=" + stateDir, "--node-name=node-a"}); err != nil {
		t.Fatal(err)
	}
	log := hivetest.Logger(t, hivetest.LogLevel(slog.LevelInfo))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := h.Start(log, ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Stop(log, context.Background()) })
	// The manifest is read and the API serves.
	for {
		ok, _ := pods.Initialized(db.ReadTxn())
		if _, err := os.Stat(client.SocketPath(stateDir)); ok && err == nil {
			break
		}
		if ctx.Err() != nil {
			t.Fatal("agent not ready in time")
		}
		time.Sleep(20 * time.Millisecond)
	}

	// Cilium gave mesh/ready the address the API shows.
	ready := strings.NewReplacer(`"10.0.1.20/32"`, `"10.0.1.30/32"`, `,
    {"address": "fd00:1::20/128", "interface": 0}`, ``)
	prev := ready.Replace(prevResult)
	stdin := strings.Replace(ready.Replace(conf(stateDir, "")), `"1s"`, `"20s"`, 1)

	// The datapath of the pod: the agent's entry, the pod's entry and the
	// program on its interface, pending until the test says done.
	setRows := func(status reconciler.Status) {
		wtxn := db.WriteTxn(redirects, attachments)
		redirects.Insert(wtxn, &redirect.Redirect{Addr: bpf.AgentKey, Kind: bpf.KindAgent, Pod: "kube-system/ztunnel", Status: reconciler.StatusDone()})
		redirects.Insert(wtxn, &redirect.Redirect{Addr: netip.MustParseAddr("10.0.1.30"), Kind: bpf.KindEnrolled, Pod: "mesh/ready", Interface: "lxcready", Status: status})
		attachments.Insert(wtxn, &redirect.Attachment{Device: "lxcready", Hook: bpf.HookFromPod, Pod: "mesh/ready", Status: reconciler.StatusDone()})
		wtxn.Commit()
	}
	setRows(reconciler.StatusPending())

	done := make(chan result, 1)
	go func() { done <- run(t, "ADD", "mesh", "ready", stdin) }()
	select {
	case r := <-done:
		t.Fatalf("ADD returned before the redirect was ready: %+v", r)
	case <-time.After(1500 * time.Millisecond):
	}
	setRows(reconciler.StatusDone())
	select {
	case r := <-done:
		if r.code != 0 {
			t.Fatalf("exit %d:\n%s\n%s", r.code, r.stdout, r.stderr)
		}
		jsonEqual(t, r.stdout, prev)
		if r.took > 10*time.Second {
			t.Fatalf("took %s: the long poll did not wake up", r.took)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("ADD still waiting after the rows were done")
	}

	// CHECK agrees.
	if r := run(t, "CHECK", "mesh", "ready", stdin); r.code != 0 {
		t.Fatalf("CHECK: exit %d: %s", r.code, r.stdout)
	}

	// A sandbox with another address is not covered by those rows.
	other := strings.Replace(strings.Replace(stdin, `"10.0.1.30/32"`, `"10.0.1.99/32"`, 1), `"20s"`, `"1s"`, 1)
	e := run(t, "ADD", "mesh", "ready", other).err(t)
	if e.Code != 11 || !strings.Contains(e.Details, "reported addresses") {
		t.Fatalf("error: %+v", e)
	}
}

// enabledDatapath is a datapath that is on: the test writes the rows the
// reconcilers would, and the CNI route only asks whether it is disabled.
type enabledDatapath struct{ redirect.Datapath }

func (enabledDatapath) Err() error { return nil }
