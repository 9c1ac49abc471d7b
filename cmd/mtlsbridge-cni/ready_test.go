// SPDX-License-Identifier: Apache-2.0

package main_test

import (
	"context"
	"log/slog"
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
	"github.com/mtlsbridge/mtlsbridge/cni"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/enrollment"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/redirect"
	"github.com/mtlsbridge/mtlsbridge/tables"
	"github.com/mtlsbridge/mtlsbridge/tables/source"
)

// TestReady: the path the whole agent cannot show without a datapath. The
// agent's cells, except the redirect module, whose ready-annotations table
// the test writes: an ADD waiting for an enrolled pod succeeds as soon as
// the pod's row turns ready, and only for the addresses that row covers.
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
		annotations statedb.RWTable[*redirect.ReadyAnnotation]
		pods        statedb.Table[*tables.Pod]
	)
	h := hive.New(
		agent.Infrastructure,
		tables.Cell, source.Cell, enrollment.Cell, api.Cell,
		cell.Module("fake-redirect", "ready-annotations written by the test",
			cell.Provide(
				redirect.NewAnnotationsTable,
				statedb.RWTable[*redirect.ReadyAnnotation].ToTable,
				func() redirect.Config { return redirect.Config{EnableRedirect: true} },
			),
		),
		cni.Cell,
		cell.Invoke(func(d *statedb.DB, a statedb.RWTable[*redirect.ReadyAnnotation], p statedb.Table[*tables.Pod]) {
			db, annotations, pods = d, a, p
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
		if _, err := os.Stat(api.SocketPath(stateDir)); ok && err == nil {
			break
		}
		if ctx.Err() != nil {
			t.Fatal("agent not ready in time")
		}
		time.Sleep(20 * time.Millisecond)
	}

	// Cilium gave mesh/ready the address the API shows (a pod that got its
	// address, then a new sandbox: the usual case once the redirect
	// derivation also reads cni-pods).
	ready := strings.NewReplacer(`"10.0.1.20/32"`, `"10.0.1.30/32"`, `,
    {"address": "fd00:1::20/128", "interface": 0}`, ``)
	prev := ready.Replace(prevResult)
	stdin := strings.Replace(ready.Replace(conf(stateDir, "")), `"1s"`, `"20s"`, 1)

	setReady := func(ok bool) {
		wtxn := db.WriteTxn(annotations)
		annotations.Insert(wtxn, &redirect.ReadyAnnotation{Pod: "mesh/ready", Ready: ok, Status: reconciler.StatusDone()})
		wtxn.Commit()
	}
	setReady(false)

	done := make(chan result, 1)
	go func() { done <- run(t, "ADD", "mesh", "ready", stdin) }()
	select {
	case r := <-done:
		t.Fatalf("ADD returned before the redirect was ready: %+v", r)
	case <-time.After(1500 * time.Millisecond):
	}
	setReady(true)
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
		t.Fatal("ADD still waiting after the row turned ready")
	}

	// CHECK agrees.
	if r := run(t, "CHECK", "mesh", "ready", stdin); r.code != 0 {
		t.Fatalf("CHECK: exit %d: %s", r.code, r.stdout)
	}

	// A sandbox with another address is not covered by the ready row.
	other := strings.Replace(strings.Replace(stdin, `"10.0.1.30/32"`, `"10.0.1.99/32"`, 1), `"20s"`, `"1s"`, 1)
	e := run(t, "ADD", "mesh", "ready", other).err(t)
	if e.Code != 11 || !strings.Contains(e.Details, "other addresses") {
		t.Fatalf("error: %+v", e)
	}
}
