// SPDX-License-Identifier: Apache-2.0

package ingest

import (
	"bytes"
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"

	"github.com/mtlsbridge/mtlsbridge/internal/manifesttest"
	"github.com/mtlsbridge/mtlsbridge/internal/syncbuf"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// folder is a manifest folder followed by a dirSource, as --source=dir runs it.
type folder struct {
	t    *testing.T
	dir  string
	w    *writeTables
	logs *syncbuf.Buffer
}

func newFolder(t *testing.T) *folder {
	db := statedb.New()
	w, err := newWriteTables(db, tables.LocalNode{NodeName: "node-a"}, slog.New(slog.DiscardHandler))
	must(t, err)
	return &folder{t: t, dir: t.TempDir(), w: w, logs: &syncbuf.Buffer{}}
}

func (f *folder) write(name, content string) {
	must(f.t, manifesttest.Write(f.dir, name, []byte(content)))
}

// run follows the folder until the test ends; it returns once the tables
// are initialized.
func (f *folder) run(maxBytes int64) {
	d := &dirSource{dir: f.dir, maxBytes: maxBytes, log: slog.New(slog.NewTextHandler(f.logs, nil)), tables: f.w, settle: 10 * time.Millisecond}
	txn := f.w.DB.WriteTxn(f.w.Pods)
	d.initDone = []func(statedb.WriteTxn){f.w.Pods.RegisterInitializer(txn, "test")}
	txn.Commit()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	health, _ := cell.NewSimpleHealth()
	go func() { d.run(ctx, health); close(done) }()
	f.t.Cleanup(func() { cancel(); <-done })
	deadline := time.After(10 * time.Second)
	for {
		ok, watch := f.w.Pods.Initialized(f.w.DB.ReadTxn())
		if ok {
			return
		}
		select {
		case <-watch:
		case <-deadline:
			f.t.Fatal("the folder's tables were not initialized: reading it hung")
		}
	}
}

func (f *folder) source(name string) *tables.Source {
	src, _, _ := f.w.Sources.Get(f.w.DB.ReadTxn(), tables.SourceByName(filePrefix+name))
	return src
}

func (f *folder) pod(key string) *tables.Pod {
	pod, _, _ := f.w.Pods.Get(f.w.DB.ReadTxn(), tables.PodByKey(key))
	return pod
}

// waitFor retries until cond holds.
func (f *folder) waitFor(what string, cond func() bool) {
	f.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			f.t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

const secret = "root:$6$rounds=5000$secrethash$/etc/shadow-content:19000:0:99999:7:::"

func pod(name, label string) string {
	return "apiVersion: v1\nkind: Pod\nmetadata: {name: " + name + ", namespace: app, labels: {tier: " + label + "}}\n" +
		"spec: {nodeName: node-a}\nstatus: {phase: Running, podIPs: [{ip: 10.0.0.1}]}\n"
}

// Only regular files inside the folder are read, up to the size limit; a
// FIFO, a device, a file outside (or a link to one), or a huge file never
// hangs the agent, grows its memory or reaches its tables and logs; the
// rest of the folder is used.
func TestFolderReadsOnlyItsRegularFiles(t *testing.T) {
	f := newFolder(t)
	f.write("good.yaml", pod("web", "front"))
	must(t, syscall.Mkfifo(filepath.Join(f.dir, "fifo.yaml"), 0o644))
	must(t, os.Symlink("/dev/zero", filepath.Join(f.dir, "zero.yaml")))
	outside := filepath.Join(t.TempDir(), "shadow")
	must(t, os.WriteFile(outside, []byte(secret+"\n"), 0o600))
	must(t, os.Symlink(outside, filepath.Join(f.dir, "shadow.yaml")))
	must(t, os.Symlink("../"+filepath.Base(f.dir)+"/../"+filepath.Base(filepath.Dir(outside))+"/shadow", filepath.Join(f.dir, "relative.yaml")))
	// A ConfigMap volume: the file is a link into a hidden folder beside it.
	must(t, os.Mkdir(filepath.Join(f.dir, "..data"), 0o755))
	must(t, os.WriteFile(filepath.Join(f.dir, "..data", "cm.yaml"), []byte(pod("api", "back")), 0o644))
	must(t, os.Symlink("..data/cm.yaml", filepath.Join(f.dir, "cm.yaml")))
	f.write("big.yaml", pod("big", "x")+"# "+strings.Repeat("x", 4096)+"\n")

	f.run(2048)
	if f.pod("app/web") == nil || f.pod("app/api") == nil {
		t.Fatal("the good files of the folder were not used")
	}
	if f.pod("app/big") != nil {
		t.Error("a file larger than the limit was read")
	}
	for name, want := range map[string]string{
		"fifo.yaml":     "not a regular file",
		"zero.yaml":     "escapes",
		"shadow.yaml":   "escapes",
		"relative.yaml": "escapes",
		"big.yaml":      "larger than --manifest-max-bytes",
	} {
		if src := f.source(name); src == nil || !strings.Contains(src.Error, want) {
			t.Errorf("%s: sources row %+v, want an error containing %q", name, src, want)
		}
	}
	dump := &bytes.Buffer{}
	must(t, f.w.DB.ReadTxn().WriteJSON(dump))
	for _, where := range []string{dump.String(), f.logs.String()} {
		if strings.Contains(where, "secrethash") {
			t.Fatalf("the content of a file outside the folder leaked:\n%s", where)
		}
	}
}

// Duplicate objects are reported in the rows of both files and the choice
// is stable: the first definition by file name and document wins.
func TestFolderReportsDuplicates(t *testing.T) {
	f := newFolder(t)
	f.write("a.yaml", pod("web", "from-a"))
	f.write("b.yaml", pod("web", "from-b")+"---\n"+pod("api", "first")+"---\n"+pod("api", "second"))
	f.run(1 << 20)
	if got := f.pod("app/web").Labels.Get("tier"); got != "from-a" {
		t.Errorf("app/web comes from %s, want a.yaml (first by name)", got)
	}
	if got := f.pod("app/api").Labels.Get("tier"); got != "first" {
		t.Errorf("app/api is its %s definition, want the first", got)
	}
	a, b := f.source("a.yaml"), f.source("b.yaml")
	for _, check := range []struct {
		row  *tables.Source
		want string
	}{
		{a, "document 1: pod app/web is defined again in file:b.yaml (document 1), which is ignored"},
		{b, "document 1: pod app/web is also defined in file:a.yaml (document 1), which is used"},
		{b, "document 3: pod app/api is also defined in file:b.yaml (document 2), which is used"},
	} {
		if !strings.Contains(check.row.TableRow()[3], check.want) {
			t.Errorf("%s: %q does not report %q", check.row.Name, check.row.TableRow()[3], check.want)
		}
	}
	if a.Objects != 1 || b.Objects != 3 {
		t.Errorf("objects %d and %d, want what each file defines (1, 3)", a.Objects, b.Objects)
	}

	// Resolving the duplicate clears the reports; an edit is picked up.
	f.write("b.yaml", pod("api", "only"))
	f.waitFor("the edit of b.yaml", func() bool {
		p := f.pod("app/api")
		return p != nil && p.Labels.Get("tier") == "only" && f.source("a.yaml").Duplicates == "" && f.source("b.yaml").Duplicates == ""
	})
	// A file that stops parsing keeps its objects; removing it drops them.
	f.write("b.yaml", "kind: [unclosed")
	f.waitFor("the broken b.yaml", func() bool { return f.source("b.yaml").Error != "" })
	if f.pod("app/api") == nil {
		t.Error("a file that stopped parsing lost its objects")
	}
	must(t, os.Remove(filepath.Join(f.dir, "b.yaml")))
	f.waitFor("the removal of b.yaml", func() bool { return f.pod("app/api") == nil && f.source("b.yaml") == nil })
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
