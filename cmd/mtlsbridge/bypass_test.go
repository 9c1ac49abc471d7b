// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"net"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/mtlsbridge/mtlsbridge/api/client"
	"github.com/mtlsbridge/mtlsbridge/internal/agenttest"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/bypass"
)

func runBypassCmd(t *testing.T, args ...string) (string, error) {
	t.Helper()
	cmd := bypassCmd()
	var out bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetArgs(args)
	cmd.SilenceUsage, cmd.SilenceErrors = true, true
	err := cmd.Execute()
	return out.String(), err
}

// TestBypassCommandDatapathDisabled runs the command against an agent
// without datapath: node-a's enrolled pods bypass, and the command says
// why and fails (exit 1).
func TestBypassCommandDatapathDisabled(t *testing.T) {
	stateDir := agenttest.Start(t, "../../testdata/demo", nil).StateDir

	// The API serves once the sources are synced.
	var (
		out string
		err error
	)
	deadline := time.Now().Add(20 * time.Second)
	for {
		out, err = runBypassCmd(t, "--state-dir="+stateDir)
		if errors.Is(err, errBypassing) || time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if !errors.Is(err, errBypassing) {
		t.Fatalf("bypass: %v, want errBypassing; output:\n%s", err, out)
	}
	t.Logf("mtlsbridge bypass:\n%s", out)
	if !strings.Contains(out, "shop/frontend") || !strings.Contains(out, bypass.GapDisabled) {
		t.Errorf("bypass output lacks shop/frontend and %q:\n%s", bypass.GapDisabled, out)
	}

	out, err = runBypassCmd(t, "--state-dir="+stateDir, "-o", "json")
	if !errors.Is(err, errBypassing) {
		t.Fatalf("bypass -o json: %v, want errBypassing", err)
	}
	var rep bypass.Report
	if err := json.Unmarshal([]byte(out), &rep); err != nil || rep.Bypassing == 0 || rep.Bypassing != len(rep.Pods) {
		t.Errorf("bypass -o json: %v, %+v", err, rep)
	}
}

// TestBypassCommandAllWell: an agent reporting no gap makes the command
// succeed (exit 0).
func TestBypassCommandAllWell(t *testing.T) {
	stateDir := shortTempDir(t)
	rep := bypass.Report{Pods: []*bypass.Bypass{{Pod: "shop/frontend"}}}
	serveFake(t, stateDir, rep)

	out, err := runBypassCmd(t, "--state-dir="+stateDir)
	if err != nil {
		t.Fatalf("bypass: %v\n%s", err, out)
	}
	if !strings.Contains(out, "shop/frontend") || !strings.Contains(out, "0 of 1 enrolled pods bypassing") {
		t.Errorf("bypass output:\n%s", out)
	}
	if _, err := runBypassCmd(t, "--state-dir="+stateDir, "-o", "yaml"); err == nil {
		t.Error("bypass -o yaml: no error")
	}
}

// TestBypassCommandWithoutAgent fails with a hint.
func TestBypassCommandWithoutAgent(t *testing.T) {
	_, err := runBypassCmd(t, "--state-dir="+t.TempDir())
	if !errors.Is(err, client.ErrUnreachable) {
		t.Errorf("bypass without agent: %v", err)
	}
}

func shortTempDir(t *testing.T) string {
	dir, err := os.MkdirTemp("", "mtlsbridge-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// serveFake answers GET /v1/bypass on the state folder's API socket.
func serveFake(t *testing.T, stateDir string, rep bypass.Report) {
	l, err := net.Listen("unix", client.SocketPath(stateDir))
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET "+bypass.APIPath, func(w http.ResponseWriter, _ *http.Request) {
		_ = json.NewEncoder(w).Encode(rep)
	})
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: time.Second}
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close() })
}
