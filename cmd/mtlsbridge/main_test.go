// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/mtlsbridge/mtlsbridge/identity"
	"github.com/mtlsbridge/mtlsbridge/internal/agenttest"
	"github.com/mtlsbridge/mtlsbridge/internal/syncbuf"
)

// Flags that make no sense stop the agent with a message naming the flag.
func TestAgentRejectsBadFlags(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--source=foo"}, `--source="foo": want "k8s" or "dir:PATH"`},
		{[]string{"--source=dir:"}, "--source=dir: needs a folder"},
		{[]string{"--source=dir:/nonexistent/manifests"}, "--source=dir:/nonexistent/manifests: stat /nonexistent/manifests: no such file or directory"},
		{[]string{"--source=dir:.", "--trust-domain=Cluster.Local"}, `--trust-domain: trust domain "Cluster.Local": character 'C' not allowed`},
		{[]string{"--source=dir:.", "--trust-domain="}, "--trust-domain: trust domain is empty"},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			cmd := rootCmd()
			cmd.SetArgs(append([]string{"agent", "--state-dir=" + t.TempDir(), "--enable-redirect=false", "--grpc-listen=127.0.0.1:0"}, tc.args...))
			cmd.SetOut(&bytes.Buffer{})
			cmd.SetErr(&bytes.Buffer{})
			done := make(chan error, 1)
			go func() { done <- cmd.Execute() }()
			select {
			case err := <-done:
				if err == nil || !strings.Contains(err.Error(), tc.want) {
					t.Fatalf("got error %v, want one containing %q", err, tc.want)
				}
			case <-time.After(30 * time.Second):
				t.Fatal("the agent did not exit on a bad flag")
			}
		})
	}
}

// db show and db dump read the tables of a running agent through its sockets.
func TestDBCommandsAgainstRunningAgent(t *testing.T) {
	stateDir := agenttest.Start(t, "../../testdata/demo", nil).StateDir

	run := func(args ...string) (string, error) {
		cmd := rootCmd()
		var out bytes.Buffer
		cmd.SetOut(&out)
		cmd.SetArgs(append(args, "--state-dir="+stateDir))
		err := cmd.Execute()
		return out.String(), err
	}

	// The sockets appear once the jobs run; the enrollments once derived:
	// a row for each pod of node-a and each enrolled pod of node-b.
	var rows []map[string]any
	deadline := time.Now().Add(20 * time.Second)
	for {
		out, err := run("db", "show", "enrollments", "-o", "json")
		if err == nil {
			rows = nil
			if err := json.Unmarshal([]byte(out), &rows); err != nil {
				t.Fatalf("db show -o json printed no JSON array: %s\n%s", err, out)
			}
			if len(rows) == 6 {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no 6 enrollments in time: last error %v, rows %d", err, len(rows))
		}
		time.Sleep(50 * time.Millisecond)
	}
	var frontend map[string]any
	for _, r := range rows {
		if r["namespace"] == "shop" && r["pod"] == "frontend" {
			frontend = r
		}
	}
	want := map[string]any{
		"namespace": "shop", "pod": "frontend", "node": "node-a", "enrolled": true,
		"reason": "namespace-label", "spiffeID": "spiffe://cluster.local/ns/shop/sa/frontend",
		"identitySpiffeID": "spiffe://cluster.local/identity/12345", "mtlsAgent": false,
	}
	for k, v := range want {
		if frontend[k] != v {
			t.Errorf("shop/frontend %s = %v, want %v (row %v)", k, frontend[k], v, frontend)
		}
	}

	out, err := run("db", "show", "enrollments")
	if err != nil || !strings.Contains(out, "payments/checkout") || !strings.Contains(out, "policy:cnp/payments/checkout-mtls") {
		t.Errorf("db show enrollments: %v\n%s", err, out)
	}
	if _, err := run("db", "show", "no-such-table"); err == nil || !strings.Contains(err.Error(), "no-such-table") {
		t.Errorf("db show of an unknown table: got %v", err)
	}

	out, err = run("db", "dump")
	if err != nil {
		t.Fatal(err)
	}
	var dump map[string][]json.RawMessage
	if err := json.Unmarshal([]byte(out), &dump); err != nil {
		t.Fatalf("db dump is not a JSON object of tables: %s", err)
	}
	for _, table := range []string{"pods", "namespaces", "policies", "nodes", "sources", "enrollments"} {
		if len(dump[table]) == 0 {
			t.Errorf("db dump has no rows of %s", table)
		}
	}
}

// Without an agent, every client command fails at once, saying why.
func TestShellWithoutAgent(t *testing.T) {
	for _, args := range [][]string{{"shell", "db"}, {"shell"}, {"health"}, {"bypass"}} {
		cmd := rootCmd()
		cmd.SetArgs(append(args, "--state-dir="+t.TempDir()))
		start := time.Now()
		err := cmd.Execute()
		if err == nil || !strings.Contains(err.Error(), "is `mtlsbridge agent` running with the same --state-dir") || time.Since(start) > 5*time.Second {
			t.Errorf("%v without an agent: %v after %s", args, err, time.Since(start))
		}
	}
}

func TestDBCommandsWithoutAgent(t *testing.T) {
	cmd := rootCmd()
	cmd.SetArgs([]string{"db", "show", "enrollments", "--state-dir=" + t.TempDir()})
	err := cmd.Execute()
	if err == nil || !strings.Contains(err.Error(), "is `mtlsbridge agent` running with the same --state-dir") {
		t.Fatalf("got %v", err)
	}
}

// ca retire without a rotation in progress says there is nothing to retire.
func TestCARetireWithNothingToRetire(t *testing.T) {
	stateDir := t.TempDir()
	if _, err := identity.LoadDir(filepath.Join(stateDir, "ca"), "cluster.local", true); err != nil {
		t.Fatal(err)
	}
	cmd := rootCmd()
	var out bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetArgs([]string{"ca", "retire", "--state-dir=" + stateDir})
	if err := cmd.Execute(); err != nil || !strings.Contains(out.String(), "Nothing to retire") {
		t.Errorf("ca retire: %v, %q", err, out.String())
	}
}

// Folder mode without --token-file starts, but says at once (log and
// /healthz warnings) that no mTLS agent can authenticate.
func TestFolderModeWithoutTokenFileSaysSo(t *testing.T) {
	a := agenttest.Start(t, "../../testdata/demo", nil, "--token-file=")
	cmd := rootCmd()
	var out bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetArgs([]string{"health", "--state-dir=" + a.StateDir})
	err := cmd.Execute()
	if !strings.Contains(out.String(), `"token-source"`) || !strings.Contains(out.String(), "no mTLS agent can authenticate") {
		t.Errorf("mtlsbridge health (%v) does not warn:\n%s", err, out.String())
	}
	if !strings.Contains(a.Logs.String(), "Folder mode without --token-file") {
		t.Error("no log line at start")
	}
}

// db show answers an operator's questions: rows of a namespace, a pod or a
// node, as a table, JSON or YAML; what the mTLS agent is told, decoded;
// the tables there are; and rows as they change.
func TestDBShowViews(t *testing.T) {
	manifests := t.TempDir()
	for _, f := range []string{"00-cluster.yaml", "10-workloads.yaml", "20-policies.yaml"} {
		b, err := os.ReadFile(filepath.Join("../../testdata/demo", f))
		must(t, err)
		must(t, os.WriteFile(filepath.Join(manifests, f), b, 0o644))
	}
	a := agenttest.Start(t, manifests, nil)
	run := func(ctx context.Context, out io.Writer, args ...string) error {
		cmd := rootCmd()
		cmd.SetOut(out)
		cmd.SetArgs(append(args, "--state-dir="+a.StateDir))
		return cmd.ExecuteContext(ctx)
	}
	show := func(args ...string) string {
		t.Helper()
		var out bytes.Buffer
		if err := run(t.Context(), &out, append([]string{"db", "show"}, args...)...); err != nil {
			t.Fatalf("db show %v: %v", args, err)
		}
		return out.String()
	}

	if out := show("enrollments", "--namespace=shop"); !strings.Contains(out, "shop/frontend") || strings.Contains(out, "payments/") {
		t.Errorf("--namespace=shop:\n%s", out)
	}
	var rows []map[string]any
	must(t, json.Unmarshal([]byte(show("enrollments", "--node=node-b", "-o", "json")), &rows))
	for _, r := range rows {
		if r["node"] != "node-b" {
			t.Errorf("--node=node-b gave %v", r)
		}
	}
	if len(rows) == 0 {
		t.Error("--node=node-b gave no rows")
	}
	if out := show("enrollments", "--pod=payments/checkout", "-o", "yaml"); !strings.Contains(out, "pod: checkout") || strings.Contains(out, "ledger") {
		t.Errorf("--pod -o yaml:\n%s", out)
	}
	var workloads []struct {
		UID      string
		Version  string
		Workload map[string]any
	}
	must(t, json.Unmarshal([]byte(show("workloads", "-o", "json", "--pod=shop/frontend")), &workloads))
	if len(workloads) != 1 || workloads[0].Workload["name"] != "frontend" || workloads[0].Workload["serviceAccount"] != "frontend" ||
		workloads[0].Version == "" {
		t.Errorf("workloads decoded: %+v", workloads)
	}
	// The datapath is off here: the rows say what would be steered, and
	// that nothing is applied.
	if out := show("redirects", "--pod=shop/frontend"); !strings.Contains(out, "enrolled") || !strings.Contains(out, "redirection disabled") {
		t.Errorf("redirects with the datapath disabled:\n%s", out)
	}
	if out := show(); !strings.Contains(out, "enrollments") || !strings.Contains(out, "workloads") {
		t.Errorf("db show lists no tables:\n%s", out)
	}
	if err := run(t.Context(), io.Discard, "db", "show", "nope"); err == nil || !strings.Contains(err.Error(), "enrollments") {
		t.Errorf("an unknown table: %v, want the tables named", err)
	}

	// One JSON style for every table: field names in lower camel case,
	// versions as strings (a 64-bit number loses digits in JSON tools).
	for _, line := range strings.Split(strings.TrimSpace(show()), "\n")[1:] {
		table := strings.Fields(line)[0]
		var rows []map[string]any
		must(t, json.Unmarshal([]byte(show(table, "-o", "json")), &rows))
		for _, r := range rows {
			for k, v := range r {
				if k == "" || strings.ToLower(k[:1]) != k[:1] || strings.ContainsAny(k, "_-") {
					t.Errorf("table %s: field %q is not lower camel case", table, k)
				}
				if _, isNumber := v.(float64); isNumber && strings.Contains(strings.ToLower(k), "version") {
					t.Errorf("table %s: field %q is a number, want a string", table, k)
				}
			}
		}
	}

	// -w: the rows that change, as they change.
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	out := &syncbuf.Buffer{}
	done := make(chan error, 1)
	go func() { done <- run(ctx, out, "db", "show", "enrollments", "-w", "--namespace=shop") }()
	for !strings.Contains(out.String(), "shop/frontend") {
		if ctx.Err() != nil {
			t.Fatalf("db show -w printed no rows:\n%s", out.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	a.WriteManifest(t, "30-more.yaml", "apiVersion: v1\nkind: Pod\nmetadata: {name: cart, namespace: shop}\nspec: {nodeName: node-a}\nstatus: {phase: Running, podIPs: [{ip: 10.0.1.77}]}\n")
	for !strings.Contains(out.String(), "shop/cart") {
		if ctx.Err() != nil {
			t.Fatalf("db show -w did not print the new pod:\n%s", out.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	<-done
}
