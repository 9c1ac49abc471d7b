// SPDX-License-Identifier: Apache-2.0

package agent_test

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/script"
	"github.com/cilium/hive/script/scripttest"

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
	// Short path: UNIX socket paths are limited to 108 bytes.
	stateDir, err := os.MkdirTemp("", "mtlsbridge-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(stateDir) })
	defaults := []string{"--state-dir=" + stateDir, "--node-name=node-a", "--grpc-listen=127.0.0.1:0",
		// The BPF datapath has tests of its own, in namespaces they create;
		// these must not touch the node's /sys/fs/bpf/mtlsbridge.
		"--enable-redirect=false"}
	h := hive.New(agent.Infrastructure, agent.Cell)
	return manifesttest.NewEngine(t, h, t.TempDir(), append(defaults, args...), nil)
}
