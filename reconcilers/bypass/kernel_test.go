// SPDX-License-Identifier: Apache-2.0

package bypass_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/pflag"

	"github.com/mtlsbridge/mtlsbridge/api"
	"github.com/mtlsbridge/mtlsbridge/api/client"
	"github.com/mtlsbridge/mtlsbridge/bpf"
	"github.com/mtlsbridge/mtlsbridge/internal/netnstest"
	"github.com/mtlsbridge/mtlsbridge/metrics"
	"github.com/mtlsbridge/mtlsbridge/nodenetns"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/bypass"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/enrollment"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/redirect"
	"github.com/mtlsbridge/mtlsbridge/statedir"
	"github.com/mtlsbridge/mtlsbridge/tables"
	"github.com/mtlsbridge/mtlsbridge/tables/ingest"
)

// waitTimeout bounds every wait of these tests.
const waitTimeout = 20 * time.Second

// node is node-a (a network namespace) with the mTLS agent pod, enrolled
// pod a and pod n, which is not enrolled; only its interface is used, as a
// wrong one.
type node struct {
	node1, node2 *netnstest.Node
	agent, a, n  *netnstest.Pod
	manifests    string
	bpfRoot      string
}

func newNode(t *testing.T) *node {
	t.Helper()
	netnstest.RequirePrivileged(t)
	nd := &node{manifests: t.TempDir(), bpfRoot: netnstest.BPFRoot(t)}
	nd.node1, nd.node2 = netnstest.NewNodes(t)
	nd.agent = nd.node1.AddPod(t, "ztunnel")
	nd.agent.MakeAgent(t)
	nd.a = nd.node1.AddPod(t, "a")
	nd.n = nd.node1.AddPod(t, "n")
	nd.write(t, true)
	return nd
}

// write puts node-a's objects in the manifest folder, as a rename: pods a
// (enrolled) and n, and the mTLS agent's pod when withAgent.
func (nd *node) write(t *testing.T, withAgent bool) {
	t.Helper()
	pod := func(name string, labels string, ips ...netip.Addr) string {
		var a []string
		for _, ip := range ips {
			a = append(a, fmt.Sprintf("{ip: %q}", ip))
		}
		return fmt.Sprintf("apiVersion: v1\nkind: Pod\nmetadata: {name: %q, namespace: app, labels: {%s}}\n"+
			"spec: {nodeName: node-a}\nstatus: {phase: Running, podIPs: [%s]}\n", name, labels, strings.Join(a, ", "))
	}
	docs := []string{
		"apiVersion: v1\nkind: Node\nmetadata: {name: node-a}\nstatus: {addresses: [{type: InternalIP, address: 192.168.100.1}]}\n",
		"apiVersion: v1\nkind: Namespace\nmetadata: {name: app}\n",
		pod("a", tables.RedirTypeLabel+": "+tables.RedirTypeWorkload, nd.a.IP4, nd.a.IP6),
		pod("n", "", nd.n.IP4, nd.n.IP6),
	}
	if withAgent {
		agent := pod("ztunnel", tables.RedirTypeLabel+": "+tables.RedirTypeProxy, nd.agent.IP4, nd.agent.IP6)
		docs = append(docs, strings.Replace(agent, "namespace: app", "namespace: kube-system", 1))
	}
	tmp := filepath.Join(nd.manifests, ".tmp")
	must(t, os.WriteFile(tmp, []byte(strings.Join(docs, "---\n")), 0o644))
	must(t, os.Rename(tmp, filepath.Join(nd.manifests, "cluster.yaml")))
}

// agent is a running hive with the redirect datapath, the local API and
// the bypass check, for node-a.
type agent struct {
	checker  *bypass.Checker
	table    statedb.Table[*bypass.Bypass]
	db       *statedb.DB
	metrics  *prometheus.Registry
	stateDir string
}

func (nd *node) startAgent(t *testing.T, extraFlags ...string) *agent {
	t.Helper()
	a := &agent{stateDir: t.TempDir()}
	h := hive.New(
		cell.SimpleHealthCell, job.Cell, statedb.Cell,
		metrics.Cell, statedir.Cell, tables.Cell, ingest.Cell, enrollment.Cell, nodenetns.Cell, redirect.Cell, api.Cell, bypass.Cell,
		cell.Invoke(func(c *bypass.Checker, tbl statedb.Table[*bypass.Bypass], db *statedb.DB, reg *prometheus.Registry) {
			a.checker, a.table, a.db, a.metrics = c, tbl, db, reg
		}),
	)
	flags := pflag.NewFlagSet("", pflag.ContinueOnError)
	h.RegisterFlags(flags)
	must(t, flags.Parse(append([]string{
		"--source=dir:" + nd.manifests, "--node-name=node-a",
		"--bpf-root=" + filepath.Join(nd.bpfRoot, "agent"),
		"--node-netns=/var/run/netns/" + nd.node1.Name,
		"--devices=" + netnstest.UplinkName,
		"--state-dir=" + a.stateDir,
		"--bypass-check-interval=100ms",
	}, extraFlags...)))
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	must(t, h.Start(hivetest.Logger(t), ctx))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
		defer cancel()
		if err := h.Stop(hivetest.Logger(t), ctx); err != nil {
			t.Errorf("stop agent: %v", err)
		}
	})
	return a
}

// waitRow checks until pod's row satisfies cond, at most waitTimeout.
func (a *agent) waitRow(t *testing.T, what, pod string, cond func(*bypass.Bypass) bool) *bypass.Bypass {
	t.Helper()
	deadline := time.Now().Add(waitTimeout)
	var last []*bypass.Bypass
	for time.Now().Before(deadline) {
		rows, err := a.checker.Check()
		if err == nil {
			last = rows
			for _, r := range rows {
				if r.Pod == pod && cond(r) {
					return r
				}
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("timed out waiting for %s; last check: %s", what, show(last))
	return nil
}

// waitGap waits until pod's row is bypassing with a gap containing every
// part.
func (a *agent) waitGap(t *testing.T, pod string, parts ...string) *bypass.Bypass {
	t.Helper()
	return a.waitRow(t, "gap "+strings.Join(parts, " "), pod, func(r *bypass.Bypass) bool {
		for _, g := range r.Gaps {
			found := true
			for _, p := range parts {
				found = found && strings.Contains(g, p)
			}
			if found {
				return r.Bypassing
			}
		}
		return false
	})
}

func (a *agent) waitClean(t *testing.T, pod string) {
	t.Helper()
	a.waitRow(t, pod+" without gaps", pod, func(r *bypass.Bypass) bool { return !r.Bypassing && len(r.Gaps) == 0 })
}

// gauge reads mtlsbridge_bypassing_pods.
func (a *agent) gauge(t *testing.T) float64 {
	t.Helper()
	mfs, err := a.metrics.Gather()
	must(t, err)
	for _, mf := range mfs {
		if mf.GetName() == "mtlsbridge_bypassing_pods" {
			return mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatal("no mtlsbridge_bypassing_pods metric")
	return 0
}

func (a *agent) client() *http.Client {
	return &http.Client{Timeout: waitTimeout, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", client.SocketPath(a.stateDir))
		},
	}}
}

// healthz reads the agent's readiness.
func (a *agent) healthz(t *testing.T) (int, api.Health) {
	t.Helper()
	var h api.Health
	deadline := time.Now().Add(waitTimeout)
	for {
		resp, err := a.client().Get("http://agent/healthz")
		if err == nil {
			defer resp.Body.Close()
			must(t, json.NewDecoder(resp.Body).Decode(&h))
			return resp.StatusCode, h
		}
		if time.Now().After(deadline) {
			t.Fatalf("GET /healthz: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// get asks the local API for a check, as `mtlsbridge bypass` does.
func (a *agent) get(t *testing.T) bypass.Report {
	t.Helper()
	client := a.client()
	var rep bypass.Report
	deadline := time.Now().Add(waitTimeout)
	for {
		resp, err := client.Get("http://agent" + bypass.APIPath)
		if err == nil {
			err = func() error {
				defer resp.Body.Close()
				if resp.StatusCode != http.StatusOK {
					return fmt.Errorf("agent answered %s", resp.Status)
				}
				return json.NewDecoder(resp.Body).Decode(&rep)
			}()
		}
		if err == nil {
			return rep
		}
		if time.Now().After(deadline) {
			t.Fatalf("GET %s: %v", bypass.APIPath, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func show(rows []*bypass.Bypass) string {
	var b strings.Builder
	for _, r := range rows {
		fmt.Fprintf(&b, "\n  %v", r.TableRow())
	}
	return b.String()
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// pinnedMap opens the agent's redirect map through its pin, as someone
// with bpftool on the node would.
func (nd *node) pinnedMap(t *testing.T) *bpf.RedirectMap {
	t.Helper()
	m, err := ebpf.LoadPinnedMap(filepath.Join(nd.bpfRoot, "agent", bpf.MapName), nil)
	must(t, err)
	t.Cleanup(func() { m.Close() })
	return bpf.NewRedirectMap(m)
}

func lookup(t *testing.T, m *bpf.RedirectMap, addr netip.Addr) bpf.Entry {
	t.Helper()
	e, ok, err := m.Lookup(addr)
	must(t, err)
	if !ok {
		t.Fatalf("no entry for %s", addr)
	}
	return e
}

// TestBypassCatchesEachGap brings node-a to all good, then breaks the
// datapath behind the agent's back in each way the check knows, and
// expects each to be named, in the table, the API's answer and the gauge.
func TestBypassCatchesEachGap(t *testing.T) {
	nd := newNode(t)
	ag := nd.startAgent(t)
	const pod = "app/a"

	// Step 1: all well: no gap, nothing bypassing. The agent pod and pods
	// not enrolled have no row.
	ag.waitClean(t, pod)
	rep := ag.get(t)
	if rep.Bypassing != 0 || len(rep.Pods) != 1 || rep.Pods[0].Pod != pod {
		t.Fatalf("GET %s with all well: %+v", bypass.APIPath, rep)
	}
	if g := ag.gauge(t); g != 0 {
		t.Errorf("mtlsbridge_bypassing_pods = %v with all well", g)
	}
	m := nd.pinnedMap(t)
	entry4 := lookup(t, m, nd.a.IP4)
	agentEntry := lookup(t, m, bpf.AgentKey)

	t.Run("entry deleted behind the agent's back", func(t *testing.T) {
		must(t, m.Delete(nd.a.IP4))
		r := ag.waitGap(t, pod, nd.a.IP4.String(), bypass.GapEntryMissing)
		if rep := ag.get(t); rep.Bypassing != 1 {
			t.Errorf("GET %s: %+v, want 1 pod bypassing", bypass.APIPath, rep)
		}
		if g := ag.gauge(t); g != 1 {
			t.Errorf("mtlsbridge_bypassing_pods = %v, want 1", g)
		}
		// The periodic check writes the same into the table.
		obj, _, ok := ag.table.Get(ag.db.ReadTxn(), bypass.ByPod(pod))
		if !ok || !obj.Bypassing {
			t.Errorf("bypass table row of %s: %v, want bypassing (%v)", pod, obj, r.Gaps)
		}
		must(t, m.Update(nd.a.IP4, entry4))
		ag.waitClean(t, pod)
	})

	t.Run("entry pointing at the wrong interface", func(t *testing.T) {
		wrong := entry4
		wrong.Ifindex = uint32(nd.n.HostIndex)
		must(t, m.Update(nd.a.IP4, wrong))
		r := ag.waitGap(t, pod, nd.a.IP4.String(), bypass.GapWrongInterface, fmt.Sprintf("ifindex %d", nd.n.HostIndex))
		t.Logf("gaps: %q", r.Gaps)
		must(t, m.Update(nd.a.IP4, entry4))
		ag.waitClean(t, pod)
	})

	t.Run("entry of another kind", func(t *testing.T) {
		must(t, m.Update(nd.a.IP4, bpf.Entry{Kind: bpf.KindLocal, NetnsID: bpf.NoNetns}))
		ag.waitGap(t, pod, nd.a.IP4.String(), bypass.GapEntryKind)
		must(t, m.Update(nd.a.IP4, entry4))
		ag.waitClean(t, pod)
	})

	t.Run("agent entry missing", func(t *testing.T) {
		must(t, m.Delete(bpf.AgentKey))
		ag.waitGap(t, pod, bypass.GapAgentMissing)
		must(t, m.Update(bpf.AgentKey, agentEntry))
		ag.waitClean(t, pod)
	})

	t.Run("agent interface down", func(t *testing.T) {
		h := nd.node1.Netlink(t)
		l, err := h.LinkByName(nd.agent.HostIf)
		must(t, err)
		must(t, h.LinkSetDown(l))
		r := ag.waitGap(t, pod, bypass.GapAgentDown, nd.agent.HostIf)
		t.Logf("gaps: %q", r.Gaps)
		must(t, h.LinkSetUp(l))
		ag.waitClean(t, pod)
	})

	t.Run("another program first", func(t *testing.T) {
		prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
			Type:         ebpf.SchedCLS,
			Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, -1), asm.Return()}, // TCX_NEXT
			License:      "Apache-2.0",
		})
		must(t, err)
		defer prog.Close()
		var l link.Link
		must(t, nd.node1.Do(func() error {
			var err error
			l, err = link.AttachTCX(link.TCXOptions{Interface: nd.a.HostIndex, Program: prog, Attach: ebpf.AttachTCXIngress, Anchor: link.Head()})
			return err
		}))
		ag.waitGap(t, pod, nd.a.HostIf, bypass.GapNotFirst)
		must(t, l.Close())
		ag.waitClean(t, pod)
	})

	t.Run("program detached", func(t *testing.T) {
		// Last: the attach reconciler puts it back only at its next
		// refresh, a minute later.
		must(t, bpf.Detach(filepath.Join(nd.bpfRoot, "agent", "links", nd.a.HostIf)))
		r := ag.waitGap(t, pod, nd.a.HostIf, bypass.GapNotAttached)
		t.Logf("gaps: %q", r.Gaps)
	})
}

// TestBypassDatapathDisabled: without the datapath every enrolled pod of
// the node bypasses, and says why.
func TestBypassDatapathDisabled(t *testing.T) {
	nd := newNode(t)
	ag := nd.startAgent(t, "--enable-redirect=false")
	ag.waitGap(t, "app/a", bypass.GapDisabled)
	if rep := ag.get(t); rep.Bypassing != 1 {
		t.Errorf("GET %s: %+v, want 1 pod bypassing", bypass.APIPath, rep)
	}
}

// TestReadiness: the agent is not ready while an enrolled pod of its node
// is not redirected (here: no mTLS agent pod yet, so no agent entry), and
// becomes ready once it is.
func TestReadiness(t *testing.T) {
	nd := newNode(t)
	nd.write(t, false)
	ag := nd.startAgent(t)

	// Step 1: sources synced, a's datapath not in place: not ready, and
	// /healthz names the bypass table's pending initializer.
	ag.waitGap(t, "app/a", bypass.GapAgentMissing)
	code, h := ag.healthz(t)
	if code != http.StatusServiceUnavailable || h.Ready || !slices.Contains(h.Pending[bypass.TableName], "datapath-in-place") {
		t.Fatalf("/healthz without the agent's entry: %d %+v, want 503 pending bypass/datapath-in-place", code, h)
	}
	select {
	case <-ag.checker.Ready():
		t.Fatal("Ready closed with a gap")
	default:
	}

	// Step 2: the mTLS agent pod comes: ready.
	nd.write(t, true)
	select {
	case <-ag.checker.Ready():
	case <-time.After(waitTimeout):
		t.Fatal("not ready in time")
	}
	code, h = ag.healthz(t)
	if code != http.StatusOK || !h.Ready {
		t.Fatalf("/healthz once redirected: %d %+v", code, h)
	}
}
