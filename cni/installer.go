// SPDX-License-Identifier: Apache-2.0

package cni

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/fsnotify/fsnotify"

	"github.com/mtlsbridge/mtlsbridge/cni/install"
	"github.com/mtlsbridge/mtlsbridge/cni/plugin"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/enrollment"
	"github.com/mtlsbridge/mtlsbridge/statedir"
)

type installerParams struct {
	cell.In

	Config     Config
	StateDir   statedir.Dir
	Enrollment enrollment.Config
	Log        *slog.Logger
	Jobs       job.Registry
	Health     cell.Health
}

func registerInstaller(p installerParams) error {
	if err := p.Config.validate(); err != nil {
		return err
	}
	if p.Config.CNIFailPolicy == plugin.FailOpen {
		p.Log.Warn("CNI fail policy is OPEN: while this agent is unreachable, enrolled pods START WITHOUT mTLS (--cni-fail-policy=open)")
	}
	if !p.Config.CNIInstall {
		return nil
	}
	bin, err := p.Config.pluginBinary()
	if err != nil {
		return err
	}
	in := &Installer{
		Config: p.Config,
		Binary: bin,
		Entry: plugin.Entry(string(p.StateDir), p.Config.CNIFailPolicy, p.Enrollment.ExcludedNamespaces,
			p.Config.CNIWait),
		Log: p.Log,
	}
	p.Jobs.NewGroup(p.Health).Add(job.OneShot("install-cni", in.Run))
	return nil
}

// Installer keeps the plugin binary in the CNI bin folder and its entry
// last in the chosen conflist. It never removes them: a stopped or
// restarting agent must keep blocking enrolled pods (removal is
// "mtlsbridge-cni uninstall").
type Installer struct {
	Config Config
	// Binary is the plugin to copy.
	Binary string
	// Entry is the plugin's conflist entry.
	Entry map[string]any
	Log   *slog.Logger
}

// Ensure installs once: the binary, then the entry. It reports the conflist
// it chained into.
//
// Possible errors: install.ErrNoConflist (Cilium has not written its
// configuration yet), file errors.
func (in *Installer) Ensure() (string, error) {
	if wrote, err := install.CopyBinary(in.Binary, in.Config.CNIBinDir); err != nil {
		return "", err
	} else if wrote {
		in.Log.Info("Installed the CNI plugin", "binary", filepath.Join(in.Config.CNIBinDir, install.PluginType))
	}
	path, err := install.FindConflist(in.Config.CNIConfDir, in.Config.CNIConflist)
	if err != nil {
		return "", err
	}
	wrote, err := install.InsertEntry(path, in.Entry)
	if err != nil {
		return path, err
	}
	if wrote {
		in.Log.Info("Chained the CNI plugin into the conflist", "conflist", path, "failPolicy", in.Config.CNIFailPolicy)
	}
	return path, nil
}

// Run installs, then watches the configuration folder and installs again
// whenever it changes (Cilium rewrites its conflist on every start). On
// stop it leaves everything in place.
func (in *Installer) Run(ctx context.Context, health cell.Health) error {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return err
	}
	defer w.Close()
	if err := w.Add(in.Config.CNIConfDir); err != nil {
		return fmt.Errorf("--cni-conf-dir: watch: %w", err)
	}
	const retry = 5 * time.Second
	for {
		path, err := in.Ensure()
		switch {
		case errors.Is(err, install.ErrNoConflist):
			health.Degraded("waiting for a conflist to chain into", err)
		case err != nil:
			in.Log.Error("Installing the CNI plugin", "error", err)
			health.Degraded("installing the CNI plugin", err)
		default:
			health.OK("chained into " + path)
		}
		var retryC <-chan time.Time
		if err != nil && !errors.Is(err, install.ErrNoConflist) {
			retryC = time.After(retry)
		}
		select {
		case <-ctx.Done():
			return nil
		case err := <-w.Errors:
			in.Log.Warn("Watching the CNI configuration folder", "error", err)
		case <-w.Events:
			// Take the burst of a rewrite together.
			drain(ctx, w.Events, 50*time.Millisecond)
		case <-retryC:
		}
	}
}

func drain(ctx context.Context, events <-chan fsnotify.Event, quiet time.Duration) {
	t := time.NewTimer(quiet)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-events:
			t.Reset(quiet)
		case <-t.C:
			return
		}
	}
}
