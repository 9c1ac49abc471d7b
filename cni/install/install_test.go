// SPDX-License-Identifier: Apache-2.0

package install_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/mtlsbridge/mtlsbridge/cni/install"
)

// ciliumConflist is what Cilium writes, with a number a float64 would
// round, to show that other fields come back out exactly.
const ciliumConflist = `{
  "cniVersion": "0.3.1",
  "name": "cilium",
  "plugins": [
    {"type": "cilium-cni", "enable-debug": false, "log-file": "/var/run/cilium/cilium-cni.log", "mtu": 9007199254740993}
  ]
}`

func entry() map[string]any {
	return map[string]any{"type": install.PluginType, "stateDir": "/var/run/mtlsbridge", "failPolicy": "closed",
		"excludedNamespaces": []string{"kube-system"}, "waitTimeout": "30s"}
}

func plugins(t *testing.T, path string) []map[string]any {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var conf struct{ Plugins []map[string]any }
	if err := json.Unmarshal(b, &conf); err != nil {
		t.Fatalf("%s: %v\n%s", path, err, b)
	}
	return conf.Plugins
}

func TestFindConflist(t *testing.T) {
	dir := t.TempDir()
	if _, err := install.FindConflist(dir, ""); !errors.Is(err, install.ErrNoConflist) {
		t.Fatalf("empty folder: %v, want ErrNoConflist", err)
	}
	for _, name := range []string{"10-other.conflist", "99-last.conflist", "00-first.conf"} {
		os.WriteFile(filepath.Join(dir, name), []byte(ciliumConflist), 0o644)
	}
	if p, _ := install.FindConflist(dir, ""); filepath.Base(p) != "10-other.conflist" {
		t.Fatalf("got %s, want the first *.conflist by name", p)
	}
	os.WriteFile(filepath.Join(dir, install.PreferredConflist), []byte(ciliumConflist), 0o644)
	if p, _ := install.FindConflist(dir, ""); filepath.Base(p) != install.PreferredConflist {
		t.Fatalf("got %s, want Cilium's", p)
	}
	if p, _ := install.FindConflist(dir, "99-last.conflist"); filepath.Base(p) != "99-last.conflist" {
		t.Fatalf("got %s, want the named one", p)
	}
	if _, err := install.FindConflist(dir, "missing.conflist"); !errors.Is(err, install.ErrNoConflist) {
		t.Fatalf("named missing: %v", err)
	}
}

func TestInsertIdempotentRemove(t *testing.T) {
	path := filepath.Join(t.TempDir(), install.PreferredConflist)
	os.WriteFile(path, []byte(ciliumConflist), 0o644)

	wrote, err := install.InsertEntry(path, entry())
	if err != nil || !wrote {
		t.Fatalf("insert: wrote=%v err=%v", wrote, err)
	}
	ps := plugins(t, path)
	if len(ps) != 2 || ps[0]["type"] != "cilium-cni" || ps[1]["type"] != install.PluginType {
		t.Fatalf("want cilium-cni then ours, got %v", ps)
	}
	b, _ := os.ReadFile(path)
	if !bytes.Contains(b, []byte("9007199254740993")) || !bytes.Contains(b, []byte(`"name": "cilium"`)) {
		t.Fatalf("other fields changed:\n%s", b)
	}
	if ok, _ := install.HasEntry(path); !ok {
		t.Fatal("HasEntry false after insert")
	}

	// Idempotent: nothing written the second time (a watcher sees no event).
	before, _ := os.Stat(path)
	if wrote, err := install.InsertEntry(path, entry()); err != nil || wrote {
		t.Fatalf("second insert: wrote=%v err=%v", wrote, err)
	}
	after, _ := os.Stat(path)
	if !os.SameFile(before, after) || !before.ModTime().Equal(after.ModTime()) {
		t.Fatal("second insert rewrote the file")
	}

	// An entry of ours elsewhere (older settings, not last) is replaced by
	// one, last.
	var conf map[string]any
	json.Unmarshal([]byte(ciliumConflist), &conf)
	old := map[string]any{"type": install.PluginType, "failPolicy": "open"}
	conf["plugins"] = []any{old, conf["plugins"].([]any)[0], old}
	b, _ = json.Marshal(conf)
	os.WriteFile(path, b, 0o644)
	if wrote, err := install.InsertEntry(path, entry()); err != nil || !wrote {
		t.Fatalf("replace: wrote=%v err=%v", wrote, err)
	}
	if ps := plugins(t, path); len(ps) != 2 || ps[1]["failPolicy"] != "closed" {
		t.Fatalf("want one entry of ours, last, closed: %v", ps)
	}

	if wrote, err := install.RemoveEntry(path); err != nil || !wrote {
		t.Fatalf("remove: wrote=%v err=%v", wrote, err)
	}
	if ps := plugins(t, path); len(ps) != 1 || ps[0]["type"] != "cilium-cni" {
		t.Fatalf("after remove: %v", ps)
	}
	if wrote, err := install.RemoveEntry(filepath.Join(t.TempDir(), "gone.conflist")); err != nil || wrote {
		t.Fatalf("remove from a missing file: wrote=%v err=%v", wrote, err)
	}
}

func TestInsertBadConflist(t *testing.T) {
	dir := t.TempDir()
	for name, content := range map[string]string{
		"broken.conflist":     `{"plugins": [`,
		"no-plugins.conflist": `{"name": "x"}`,
	} {
		path := filepath.Join(dir, name)
		os.WriteFile(path, []byte(content), 0o644)
		if _, err := install.InsertEntry(path, entry()); err == nil {
			t.Errorf("%s: no error", name)
		}
		if b, _ := os.ReadFile(path); string(b) != content {
			t.Errorf("%s: changed to %s", name, b)
		}
	}
}

func TestCopyBinaryAndUninstall(t *testing.T) {
	confDir, binDir := t.TempDir(), filepath.Join(t.TempDir(), "bin")
	src := filepath.Join(t.TempDir(), "plugin")
	os.WriteFile(src, []byte("#!/bin/true\n"), 0o755)
	if wrote, err := install.CopyBinary(src, binDir); err != nil || !wrote {
		t.Fatalf("copy: wrote=%v err=%v", wrote, err)
	}
	if wrote, err := install.CopyBinary(src, binDir); err != nil || wrote {
		t.Fatalf("second copy: wrote=%v err=%v", wrote, err)
	}
	fi, err := os.Stat(filepath.Join(binDir, install.PluginType))
	if err != nil || fi.Mode().Perm() != 0o755 {
		t.Fatalf("binary: %v %v", fi, err)
	}
	for _, name := range []string{"05-cilium.conflist", "10-other.conflist"} {
		p := filepath.Join(confDir, name)
		os.WriteFile(p, []byte(ciliumConflist), 0o644)
		install.InsertEntry(p, entry())
	}
	var log strings.Builder
	if err := install.Uninstall(confDir, binDir, &log); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"05-cilium.conflist", "10-other.conflist"} {
		if ok, _ := install.HasEntry(filepath.Join(confDir, name)); ok {
			t.Errorf("%s still has the entry", name)
		}
	}
	if _, err := os.Stat(filepath.Join(binDir, install.PluginType)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("binary still there: %v", err)
	}
	if !strings.Contains(log.String(), "removed "+install.PluginType) {
		t.Errorf("log: %q", log.String())
	}
	// Twice is fine.
	if err := install.Uninstall(confDir, binDir, &log); err != nil {
		t.Fatal(err)
	}
}
