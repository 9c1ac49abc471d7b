// SPDX-License-Identifier: Apache-2.0

package redirect_test

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"github.com/spf13/pflag"
	"github.com/vishvananda/netlink"

	"github.com/mtlsbridge/mtlsbridge/bpf"
	"github.com/mtlsbridge/mtlsbridge/internal/netnstest"
	"github.com/mtlsbridge/mtlsbridge/metrics"
	"github.com/mtlsbridge/mtlsbridge/nodenetns"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/enrollment"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/redirect"
	"github.com/mtlsbridge/mtlsbridge/tables"
	"github.com/mtlsbridge/mtlsbridge/tables/ingest"
)

// rowError is the error in the status of a row, "" if it has none.
func rowError(s reconciler.Status) string {
	if s.Kind != reconciler.StatusKindError {
		return ""
	}
	return s.GetError()
}

// TestBadInput: a missing mTLS agent, a missing uplink, a pod whose
// interface goes away. Each shows in its row and is retried; the other
// rows and the traffic they steer are not affected.
func TestBadInput(t *testing.T) {
	c := newCluster(t)
	c.write(t, manifest{enrollA: true, withAgent: false})
	ag := c.startAgent(t, "--devices="+netnstest.UplinkName+",up1")
	done := reconciler.StatusKindDone
	hasError := func(err error) func(s reconciler.Status) bool {
		return func(s reconciler.Status) bool { return strings.Contains(rowError(s), err.Error()) }
	}
	agentRow := func(txn statedb.ReadTxn, ok func(reconciler.Status) bool) bool {
		r, _, found := ag.redirects.Get(txn, redirect.RedirectByAddr(bpf.AgentKey))
		return found && ok(r.Status)
	}
	deviceRow := func(txn statedb.ReadTxn, device string, ok func(reconciler.Status) bool) bool {
		a, _, found := ag.attachments.Get(txn, redirect.AttachmentByDevice(device))
		return found && ok(a.Status)
	}

	// Step 1: no agent pod, no up1. Their rows say so; a's are in place.
	ag.waitFor(t, "agent and up1 rows with errors, a's rows done", func(txn statedb.ReadTxn) bool {
		return agentRow(txn, hasError(redirect.ErrNoAgent)) && deviceRow(txn, "up1", hasError(redirect.ErrNoDevice)) &&
			ag.redirectIs(txn, c.a.IP4, bpf.KindEnrolled, done) && ag.attachmentIs(txn, c.a.HostIf, done) &&
			ag.attachmentIs(txn, netnstest.UplinkName, done)
	})
	// Without an agent, a cannot open a connection across nodes (fail
	// closed); n can, and a can reach n.
	if ans, err := c.a.Ask(netip.AddrPortFrom(c.r.IP4, 8080)); err == nil {
		t.Errorf("a -> r without an agent: answered by %s, want no connection", ans)
	}
	if ans := ask(t, c.n, c.r.IP4, 8080); ans.Server != "r" {
		t.Errorf("n -> r answered by %s", ans)
	}
	if ans := ask(t, c.a, c.n.IP4, 8080); ans.Server != "n" {
		t.Errorf("a -> n answered by %s", ans)
	}

	// Step 2: the agent pod appears; up1 appears.
	c.write(t, manifest{enrollA: true, withAgent: true})
	nh := c.node1.Netlink(t)
	must(t, nh.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "up1"}, PeerName: "up1peer"}))
	ag.waitFor(t, "agent and up1 rows done", func(txn statedb.ReadTxn) bool {
		return ag.redirectIs(txn, bpf.AgentKey, bpf.KindAgent, done) && ag.attachmentIs(txn, "up1", done)
	})
	if ans := ask(t, c.a, c.r.IP4, 8080); ans.Server != "agent" {
		t.Errorf("a -> r with the agent back: answered by %s", ans)
	}

	// Step 3: up1 goes away.
	up1, err := nh.LinkByName("up1")
	must(t, err)
	must(t, nh.LinkDel(up1))
	ag.waitFor(t, "up1 row with an error", func(txn statedb.ReadTxn) bool {
		return deviceRow(txn, "up1", hasError(redirect.ErrNoDevice))
	})

	// Step 4: a's interface goes away (the pod is being torn down): its
	// rows say so, the rest keeps working. Its attachment row stays until
	// the pod is no longer enrolled: a scan that misses an interface must
	// never detach a running pod's program (the kernel dropped this one
	// with the device).
	c.a.Remove(t)
	ag.waitFor(t, "a's rows with an error", func(txn statedb.ReadTxn) bool {
		r, _, ok := ag.redirects.Get(txn, redirect.RedirectByAddr(c.a.IP4))
		_, _, attached := ag.attachments.Get(txn, redirect.AttachmentByDevice(c.a.HostIf))
		return ok && hasError(redirect.ErrNoInterface)(r.Status) && attached
	})
	if ans := ask(t, c.n, c.r.IP4, 8080); ans.Server != "r" {
		t.Errorf("n -> r answered by %s", ans)
	}
	if ans := ask(t, c.r, c.n.IP4, 15008); ans.Server != "n" {
		t.Errorf("r -> n:15008 answered by %s", ans)
	}
	// The pod leaves the API: its attachment row goes.
	c.write(t, manifest{enrollA: true, withAgent: true, withoutA: true})
	ag.waitFor(t, "a's rows gone", func(txn statedb.ReadTxn) bool {
		_, _, entry := ag.redirects.Get(txn, redirect.RedirectByAddr(c.a.IP4))
		_, _, attached := ag.attachments.Get(txn, redirect.AttachmentByDevice(c.a.HostIf))
		return !entry && !attached
	})
}

// TestMappedAddressNeverUnsteers: a pod that is not enrolled claims an
// enrolled pod's IPv4 address spelled IPv4-mapped (::ffff:a.b.c.d). Both
// spellings are one key of the redirect map: before addresses were
// unmapped at every input, the two rows took turns at it, and the enrolled
// pod's entry was "local" in 12 of 40 passes, its new connections not
// steered. Now the conflict is one row, the enrolled pod's, in every pass.
func TestMappedAddressNeverUnsteers(t *testing.T) {
	c := newCluster(t)
	c.write(t, manifest{enrollA: true, withAgent: true, imposter: true})
	ag := c.startAgent(t)
	ag.waitFor(t, "a's entry done", func(txn statedb.ReadTxn) bool {
		return ag.redirectIs(txn, c.a.IP4, bpf.KindEnrolled, reconciler.StatusKindDone)
	})
	m, err := ebpf.LoadPinnedMap(filepath.Join(c.bpfRoot, "agent", bpf.MapName), &ebpf.LoadPinOptions{ReadOnly: true})
	must(t, err)
	defer m.Close()
	entries := bpf.NewRedirectMap(m)
	for gen := 1; gen <= 40; gen++ {
		c.write(t, manifest{enrollA: true, withAgent: true, imposter: true, gen: gen})
		ag.waitFor(t, fmt.Sprintf("pass %d", gen), func(txn statedb.ReadTxn) bool {
			n, _, ok := ag.pods.Get(txn, tables.PodByKey("app/n"))
			return ok && n.Labels.Get("gen") == fmt.Sprintf("g%d", gen)
		})
		time.Sleep(60 * time.Millisecond) // one derivation pass and its reconciliation
		e, ok, err := entries.Lookup(c.a.IP4)
		if err != nil || !ok || e.Kind != bpf.KindEnrolled || int(e.Ifindex) != c.a.HostIndex {
			t.Fatalf("pass %d: a's entry %v (present %v, %v), want enrolled on %s", gen, e, ok, err, c.a.HostIf)
		}
		txn := ag.db.ReadTxn()
		if r, _, _ := ag.redirects.Get(txn, redirect.RedirectByAddr(c.a.IP4)); r == nil || r.Pod != "app/a" {
			t.Fatalf("pass %d: row of %s is %v, want a's", gen, c.a.IP4, r)
		}
		for r := range ag.redirects.All(txn) {
			if r.Addr.Is4In6() {
				t.Fatalf("pass %d: a row keyed by the mapped spelling %s", gen, r.Addr)
			}
		}
	}
	if ans := ask(t, c.a, c.r.IP4, 8080); ans.Server != "agent" {
		t.Errorf("a -> r answered by %s, want the agent", ans)
	}
}

// TestDatapathUnavailable: without BPF (here: a --bpf-root that is not on
// bpffs; for a normal user: no permission) the agent runs on, and the rows
// say why nothing is steered. Needs no privileges.
func TestDatapathUnavailable(t *testing.T) {
	manifests := t.TempDir()
	// TEST-NET addresses: no interface of this machine has them.
	must(t, os.WriteFile(filepath.Join(manifests, "pods.yaml"), []byte(`
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: app, labels: {cilium.io/redir-type: workload}}
spec: {nodeName: node-a}
status: {phase: Running, podIPs: [{ip: 192.0.2.10}]}
---
apiVersion: v1
kind: Pod
metadata: {name: batch, namespace: app}
spec: {nodeName: node-a}
status: {phase: Running, podIPs: [{ip: 192.0.2.11}]}
`), 0o644))
	var (
		db        *statedb.DB
		redirects statedb.Table[*redirect.Redirect]
		pods      statedb.Table[*tables.Pod]
	)
	h := hive.New(
		cell.SimpleHealthCell, job.Cell, statedb.Cell,
		metrics.Cell, tables.Cell, ingest.Cell, enrollment.Cell, nodenetns.Cell, redirect.Cell,
		cell.Invoke(func(d *statedb.DB, r statedb.Table[*redirect.Redirect], p statedb.Table[*tables.Pod]) {
			db, redirects, pods = d, r, p
		}),
	)
	flags := pflag.NewFlagSet("", pflag.ContinueOnError)
	h.RegisterFlags(flags)
	must(t, flags.Parse([]string{"--source=dir:" + manifests, "--node-name=node-a", "--bpf-root=" + filepath.Join(t.TempDir(), "bpf")}))
	log := hivetest.Logger(t)
	must(t, h.Start(log, t.Context()))
	defer h.Stop(log, t.Context())

	deadline := time.Now().Add(waitTimeout)
	for {
		txn := db.ReadTxn()
		web, _, ok1 := redirects.Get(txn, redirect.RedirectByAddr(netip.MustParseAddr("192.0.2.10")))
		batch, _, ok2 := redirects.Get(txn, redirect.RedirectByAddr(netip.MustParseAddr("192.0.2.11")))
		if ok1 && ok2 && strings.Contains(rowError(web.Status), redirect.ErrNoInterface.Error()) &&
			strings.Contains(rowError(batch.Status), redirect.ErrDatapathUnavailable.Error()) &&
			strings.Contains(rowError(batch.Status), bpf.ErrNotBPFFS.Error()) {
			break
		}
		if time.Now().After(deadline) {
			var rows []string
			for r := range redirects.All(txn) {
				rows = append(rows, strings.Join(r.TableRow(), " | "))
			}
			t.Fatalf("rows:\n%s", strings.Join(rows, "\n"))
		}
		time.Sleep(50 * time.Millisecond)
	}
	// The rest of the agent carries on.
	if n := pods.NumObjects(db.ReadTxn()); n != 2 {
		t.Fatalf("%d pods", n)
	}
}
