// SPDX-License-Identifier: Apache-2.0

package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mtlsbridge/mtlsbridge/api/client"
	"github.com/mtlsbridge/mtlsbridge/internal/cnitest"
	"github.com/mtlsbridge/mtlsbridge/internal/syncbuf"
)

// TestSecondAgentWaitsForTheFirst: a second agent on the same state folder
// (a rolling update with surge, a run by hand) waits, naming the first;
// the first keeps its sockets and stays reachable; the second takes over
// once the first is gone.
func TestSecondAgentWaitsForTheFirst(t *testing.T) {
	bin := filepath.Join(cnitest.Binaries(t), "mtlsbridge")
	stateDir, err := os.MkdirTemp("", "mtlsb-lock-")
	must(t, err)
	t.Cleanup(func() { os.RemoveAll(stateDir) })
	start := func(name string) (*exec.Cmd, *syncbuf.Buffer) {
		logs := &syncbuf.Buffer{}
		cmd := exec.Command(bin, "agent", "--source=dir:../../testdata/demo", "--state-dir="+stateDir,
			"--node-name=node-a", "--enable-redirect=false", "--grpc-listen=127.0.0.1:0")
		cmd.Stdout, cmd.Stderr = logs, logs
		must(t, cmd.Start())
		t.Cleanup(func() {
			cmd.Process.Kill()
			cmd.Wait()
			if t.Failed() {
				t.Logf("%s's log:\n%s", name, logs.String())
			}
		})
		return cmd, logs
	}
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for !cond() {
			if time.Now().After(deadline) {
				t.Fatalf("timed out waiting for %s", what)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	ready := func() bool {
		var h struct{ Ready bool }
		return client.New(stateDir).GetJSON(context.Background(), "/healthz", &h) == nil && h.Ready
	}

	first, _ := start("first agent")
	waitFor("the first agent", ready)
	second, secondLogs := start("second agent")
	waitFor("the second agent to wait", func() bool {
		return strings.Contains(secondLogs.String(), "Waiting for state folder")
	})
	if want := "mtlsbridge agent pid " + strconv.Itoa(first.Process.Pid); !strings.Contains(secondLogs.String(), want) {
		t.Errorf("the waiting agent does not name the holder (%q):\n%s", want, secondLogs.String())
	}
	// The first agent still serves, on its own sockets.
	time.Sleep(time.Second)
	if !ready() {
		t.Fatal("the first agent is unreachable while the second waits")
	}
	var out strings.Builder
	if err := client.Shell(context.Background(), stateDir, &out, "db/show enrollments"); err != nil || !strings.Contains(out.String(), "shop/frontend") {
		t.Fatalf("db/show on the first agent: %v\n%s", err, out.String())
	}

	must(t, first.Process.Signal(syscall.SIGTERM))
	first.Wait()
	waitFor("the second agent to take over", func() bool {
		return strings.Contains(secondLogs.String(), "Took over state folder") && ready()
	})
	if second.ProcessState != nil {
		t.Fatal("the second agent exited")
	}
}
