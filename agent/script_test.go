// SPDX-License-Identifier: Apache-2.0

package agent_test

import (
	"context"
	"maps"
	"os"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/script"
	"github.com/cilium/hive/script/scripttest"
	"github.com/spf13/pflag"

	"github.com/mtlsbridge/mtlsbridge/agent"
	"github.com/mtlsbridge/mtlsbridge/internal/manifesttest"
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
	maps.Insert(cmds, maps.All(manifesttest.ScriptCommands(manifests)))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		h.Stop(log, ctx)
	})
	return &script.Engine{Cmds: cmds}
}
