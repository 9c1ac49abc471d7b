// SPDX-License-Identifier: Apache-2.0

package cni

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"

	"github.com/mtlsbridge/mtlsbridge/cni/install"
	"github.com/mtlsbridge/mtlsbridge/cni/plugin"
)

const ciliumConflist = `{"cniVersion": "0.3.1", "name": "cilium", "plugins": [{"type": "cilium-cni"}]}`

// writeLikeCilium replaces the conflist atomically, without our entry, as
// a starting Cilium agent does.
func writeLikeCilium(t *testing.T, dir string) {
	t.Helper()
	tmp := filepath.Join(dir, ".cilium-tmp")
	if err := os.WriteFile(tmp, []byte(ciliumConflist), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, install.PreferredConflist)); err != nil {
		t.Fatal(err)
	}
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting until %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestInstaller: the plugin is chained once Cilium's conflist exists, again
// after each rewrite by Cilium, stays after the agent stops, and goes only
// with the explicit uninstall.
func TestInstaller(t *testing.T) {
	confDir, binDir := t.TempDir(), t.TempDir()
	src := filepath.Join(t.TempDir(), "mtlsbridge-cni")
	os.WriteFile(src, []byte("plugin"), 0o755)
	conflist := filepath.Join(confDir, install.PreferredConflist)
	has := func() bool { ok, _ := install.HasEntry(conflist); return ok }

	in := &Installer{
		Config: Config{CNIInstall: true, CNIConfDir: confDir, CNIBinDir: binDir, CNIFailPolicy: plugin.FailClosed},
		Binary: src,
		Entry:  plugin.Entry("/var/run/mtlsbridge", plugin.FailClosed, []string{"kube-system"}, 30*time.Second),
		Log:    hivetest.Logger(t, hivetest.LogLevel(slog.LevelDebug)),
	}
	ctx, cancel := context.WithCancel(context.Background())
	health := &fakeHealth{}
	var wg sync.WaitGroup
	wg.Go(func() {
		if err := in.Run(ctx, health); err != nil {
			t.Error(err)
		}
	})

	// No conflist yet: the binary is there, health says what it waits for.
	eventually(t, "the binary is copied", func() bool {
		_, err := os.Stat(filepath.Join(binDir, install.PluginType))
		return err == nil
	})
	eventually(t, "health reports the missing conflist", func() bool {
		return errors.Is(health.lastErr(), install.ErrNoConflist)
	})

	writeLikeCilium(t, confDir)
	eventually(t, "the entry is inserted", has)
	for range 3 {
		writeLikeCilium(t, confDir)
		eventually(t, "the entry is inserted again after Cilium's rewrite", has)
	}

	// Stop: nothing is removed, so that pods stay blocked while the agent is
	// down.
	cancel()
	wg.Wait()
	if !has() {
		t.Fatal("entry removed on stop")
	}
	if _, err := os.Stat(filepath.Join(binDir, install.PluginType)); err != nil {
		t.Fatalf("binary removed on stop: %v", err)
	}

	if err := install.Uninstall(confDir, binDir, os.Stderr); err != nil {
		t.Fatal(err)
	}
	if has() {
		t.Fatal("entry still there after uninstall")
	}
}

func TestConfigValidate(t *testing.T) {
	for _, c := range []Config{
		{CNIFailPolicy: "maybe", CNIWait: time.Second},
		{CNIFailPolicy: plugin.FailClosed, CNIWait: 0},
	} {
		if err := c.validate(); err == nil {
			t.Errorf("%+v: no error", c)
		}
	}
	if err := defaultConfig.validate(); err != nil {
		t.Error(err)
	}
}

type fakeHealth struct {
	mu  sync.Mutex
	err error
}

func (h *fakeHealth) OK(string)      { h.mu.Lock(); h.err = nil; h.mu.Unlock() }
func (h *fakeHealth) Stopped(string) {}
func (h *fakeHealth) Degraded(_ string, err error) {
	h.mu.Lock()
	h.err = err
	h.mu.Unlock()
}
func (h *fakeHealth) NewScope(string) cell.Health { return h }
func (h *fakeHealth) Close()                      {}
func (h *fakeHealth) lastErr() error              { h.mu.Lock(); defer h.mu.Unlock(); return h.err }
