// SPDX-License-Identifier: Apache-2.0

package agent_test

import (
	"context"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/script"
	"github.com/cilium/hive/script/scripttest"
	"github.com/spf13/pflag"

	"github.com/mtlsbridge/mtlsbridge/agent"
)

// TestScript runs the cross-cell scripts in ../testdata: the agent with the
// manifest folder source, driven by writing and removing manifest files.
func TestScript(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	scripttest.Test(t, ctx, newEngine, nil, "../testdata/*.txtar")
}

func newEngine(t testing.TB, args []string) *script.Engine {
	log := hivetest.Logger(t)
	manifests := t.TempDir()
	// Short path: UNIX socket paths are limited to 108 bytes.
	stateDir, err := os.MkdirTemp("", "mtlsbridge-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(stateDir) })

	h := hive.New(agent.Infrastructure, agent.Cell)
	flags := pflag.NewFlagSet("", pflag.ContinueOnError)
	h.RegisterFlags(flags)
	defaults := []string{"--source=dir:" + manifests, "--state-dir=" + stateDir, "--node-name=node-a", "--grpc-listen=127.0.0.1:0",
		// The BPF datapath has tests of its own, in namespaces they create;
		// these must not touch the node's /sys/fs/bpf/mtlsbridge.
		"--enable-redirect=false"}
	if err := flags.Parse(append(defaults, args...)); err != nil {
		t.Fatalf("flags %v: %s", args, err)
	}

	cmds, err := h.ScriptCommands(log)
	if err != nil {
		t.Fatal(err)
	}
	maps.Insert(cmds, maps.All(script.DefaultCmds()))
	cmds["manifests/write"] = manifestsWriteCmd(manifests)
	cmds["manifests/rm"] = manifestsRemoveCmd(manifests)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		h.Stop(log, ctx)
	})
	return &script.Engine{Cmds: cmds}
}

// manifestsWriteCmd copies files of the script into the manifest folder. Each
// lands by rename, as an editor or kubectl-style tool would save it.
func manifestsWriteCmd(dir string) script.Cmd {
	return script.Command(
		script.CmdUsage{Summary: "copy files into the manifest folder", Args: "file... [--as=NAME]"},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			if len(args) == 0 {
				return nil, script.ErrUsage
			}
			as := ""
			if last := args[len(args)-1]; len(last) > 5 && last[:5] == "--as=" {
				as, args = last[5:], args[:len(args)-1]
			}
			for _, name := range args {
				content, err := os.ReadFile(s.Path(name))
				if err != nil {
					return nil, err
				}
				target := filepath.Base(name)
				if as != "" {
					target = as
				}
				tmp := filepath.Join(dir, ".tmp-"+target)
				if err := os.WriteFile(tmp, content, 0o644); err != nil {
					return nil, err
				}
				if err := os.Rename(tmp, filepath.Join(dir, target)); err != nil {
					return nil, err
				}
			}
			return nil, nil
		},
	)
}

func manifestsRemoveCmd(dir string) script.Cmd {
	return script.Command(
		script.CmdUsage{Summary: "remove files from the manifest folder", Args: "name..."},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			for _, name := range args {
				if err := os.Remove(filepath.Join(dir, name)); err != nil {
					return nil, fmt.Errorf("manifests/rm: %w", err)
				}
			}
			return nil, nil
		},
	)
}
