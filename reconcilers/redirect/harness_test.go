// SPDX-License-Identifier: Apache-2.0

package redirect_test

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"github.com/spf13/pflag"

	"github.com/mtlsbridge/mtlsbridge/bpf"
	"github.com/mtlsbridge/mtlsbridge/internal/netnstest"
	"github.com/mtlsbridge/mtlsbridge/metrics"
	"github.com/mtlsbridge/mtlsbridge/nodenetns"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/enrollment"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/readiness"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/redirect"
	"github.com/mtlsbridge/mtlsbridge/tables"
	"github.com/mtlsbridge/mtlsbridge/tables/ingest"
)

// waitTimeout bounds every wait of these tests.
const waitTimeout = 20 * time.Second

// cluster is node-a (netns node1) with the mTLS agent and pods a, n, and
// node-b (node2) with pod r. Only node-a runs an agent.
type cluster struct {
	node1, node2 *netnstest.Node
	agent        *netnstest.Pod
	a, n, r      *netnstest.Pod
	manifests    string
	bpfRoot      string
}

// ghostIP is the address of an enrolled pod that has no interface.
var ghostIP = netip.MustParseAddr("10.1.0.99")

func newCluster(t *testing.T) *cluster {
	t.Helper()
	netnstest.RequirePrivileged(t)
	c := &cluster{manifests: t.TempDir(), bpfRoot: netnstest.BPFRoot(t)}
	c.node1, c.node2 = netnstest.NewNodes(t)
	c.agent = c.node1.AddPod(t, "ztunnel")
	c.agent.MakeAgent(t)
	c.a = c.node1.AddPod(t, "a")
	c.n = c.node1.AddPod(t, "n")
	c.r = c.node2.AddPod(t, "r")

	// Every pod answers on 8080 and 15008 with its name; the agent answers
	// whatever the destination (transparent), as ztunnel's TPROXY
	// listeners do.
	for _, p := range []*netnstest.Pod{c.a, c.n, c.r} {
		p.Serve(t, p.Name, 8080, false, p.IP4, p.IP6)
		p.Serve(t, p.Name, 15008, false, p.IP4, p.IP6)
	}
	any4, any6 := netip.IPv4Unspecified(), netip.IPv6Unspecified()
	c.agent.Serve(t, "agent", 8080, true, any4, any6)
	c.agent.Serve(t, "agent", 15008, true, any4, any6)
	return c
}

type manifest struct {
	enrollA   bool
	enrollN   bool
	withAgent bool
	withoutN  bool
	withoutA  bool
	// imposter adds an opt-out pod claiming a's IPv4 address spelled
	// IPv4-mapped; gen changes n's labels, so that each write is a change.
	imposter bool
	gen      int
}

// write puts the cluster's objects in the manifest folder, as a rename.
func (c *cluster) write(t *testing.T, m manifest) {
	t.Helper()
	pod := func(name, node string, labels map[string]string, ips ...netip.Addr) string {
		var l, a []string
		for k, v := range labels {
			l = append(l, fmt.Sprintf("%s: %s", k, v))
		}
		for _, ip := range ips {
			a = append(a, fmt.Sprintf("{ip: %q}", ip))
		}
		return fmt.Sprintf("apiVersion: v1\nkind: Pod\nmetadata: {name: %q, namespace: app, labels: {%s}}\n"+
			"spec: {nodeName: %s}\nstatus: {phase: Running, podIPs: [%s]}\n", name, strings.Join(l, ", "), node, strings.Join(a, ", "))
	}
	workload := map[string]string{tables.RedirTypeLabel: tables.RedirTypeWorkload}
	docs := []string{
		"apiVersion: v1\nkind: Node\nmetadata: {name: node-a}\nstatus: {addresses: [{type: InternalIP, address: 192.168.100.1}]}\n",
		"apiVersion: v1\nkind: Namespace\nmetadata: {name: app}\n",
		pod("ghost", "node-a", workload, ghostIP),
		pod("r", "node-b", workload, c.r.IP4, c.r.IP6),
	}
	if !m.withoutN {
		labels := map[string]string{"gen": fmt.Sprintf("g%d", m.gen)}
		if m.enrollN {
			labels[tables.RedirTypeLabel] = tables.RedirTypeWorkload
		}
		docs = append(docs, pod("n", "node-a", labels, c.n.IP4, c.n.IP6))
	}
	if m.imposter {
		mapped := netip.AddrFrom16(c.a.IP4.As16())
		docs = append(docs, pod("imposter", "node-a", map[string]string{tables.RedirTypeLabel: tables.RedirTypeNone}, mapped))
	}
	switch {
	case m.withoutA:
	case m.enrollA:
		docs = append(docs, pod("a", "node-a", workload, c.a.IP4, c.a.IP6))
	default:
		docs = append(docs, pod("a", "node-a", nil, c.a.IP4, c.a.IP6))
	}
	if m.withAgent {
		agent := pod("ztunnel", "node-a", map[string]string{tables.RedirTypeLabel: tables.RedirTypeProxy}, c.agent.IP4, c.agent.IP6)
		docs = append(docs, strings.Replace(agent, "namespace: app", "namespace: kube-system", 1))
	}
	tmp := filepath.Join(c.manifests, ".tmp")
	must(t, os.WriteFile(tmp, []byte(strings.Join(docs, "---\n")), 0o644))
	must(t, os.Rename(tmp, filepath.Join(c.manifests, "cluster.yaml")))
}

// agent is a running mtlsbridge hive with the tables, sources, enrollment
// and redirect cells, for node-a.
type agent struct {
	h           *hive.Hive
	db          *statedb.DB
	redirects   statedb.Table[*redirect.Redirect]
	attachments statedb.Table[*redirect.Attachment]
	pods        statedb.Table[*tables.Pod]
}

func (c *cluster) startAgent(t *testing.T, extraFlags ...string) *agent {
	t.Helper()
	a := &agent{}
	a.h = hive.New(
		cell.SimpleHealthCell, job.Cell, statedb.Cell,
		metrics.Cell, tables.Cell, ingest.Cell, enrollment.Cell, nodenetns.Cell, redirect.Cell, readiness.Cell,
		cell.Invoke(func(db *statedb.DB, r statedb.Table[*redirect.Redirect], at statedb.Table[*redirect.Attachment], p statedb.Table[*tables.Pod]) {
			a.db, a.redirects, a.attachments, a.pods = db, r, at, p
		}),
	)
	flags := pflag.NewFlagSet("", pflag.ContinueOnError)
	a.h.RegisterFlags(flags)
	args := append([]string{
		"--source=dir:" + c.manifests, "--node-name=node-a",
		"--bpf-root=" + filepath.Join(c.bpfRoot, "agent"),
		"--node-netns=/var/run/netns/" + c.node1.Name,
		"--devices=" + netnstest.UplinkName,
	}, extraFlags...)
	must(t, flags.Parse(args))
	log := hivetest.Logger(t)
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	must(t, a.h.Start(log, ctx))
	t.Cleanup(func() { a.stop(t) })
	return a
}

func (a *agent) stop(t *testing.T) {
	if a.h == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	if err := a.h.Stop(hivetest.Logger(t), ctx); err != nil {
		t.Errorf("stop agent: %v", err)
	}
	a.h = nil
}

// waitFor waits until cond holds on the tables, at most waitTimeout.
func (a *agent) waitFor(t *testing.T, what string, cond func(txn statedb.ReadTxn) bool) {
	t.Helper()
	deadline := time.After(waitTimeout)
	for {
		txn := a.db.ReadTxn()
		_, w1 := a.redirects.AllWatch(txn)
		_, w2 := a.attachments.AllWatch(txn)
		if cond(txn) {
			return
		}
		select {
		case <-w1:
		case <-w2:
		case <-time.After(200 * time.Millisecond): // conditions may read other tables
		case <-deadline:
			t.Fatalf("timed out waiting for %s; tables:\n%s", what, a.dump(txn))
		}
	}
}

func (a *agent) dump(txn statedb.ReadTxn) string {
	var b strings.Builder
	for r := range a.redirects.All(txn) {
		fmt.Fprintf(&b, "  redirect %v\n", r.TableRow())
	}
	for at := range a.attachments.All(txn) {
		fmt.Fprintf(&b, "  attachment %v\n", at.TableRow())
	}
	return b.String()
}

// redirectIs reports whether the row of addr has kind and status.
func (a *agent) redirectIs(txn statedb.ReadTxn, addr netip.Addr, kind bpf.Kind, status reconciler.StatusKind) bool {
	r, _, ok := a.redirects.Get(txn, redirect.RedirectByAddr(addr))
	return ok && r.Kind == kind && r.Status.Kind == status
}

func (a *agent) attachmentIs(txn statedb.ReadTxn, device string, status reconciler.StatusKind) bool {
	at, _, ok := a.attachments.Get(txn, redirect.AttachmentByDevice(device))
	return ok && at.Status.Kind == status
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// ask connects from one pod to another's address and port and returns the
// answer, failing the test if there is none.
func ask(t *testing.T, from *netnstest.Pod, to netip.Addr, port uint16) netnstest.Answer {
	t.Helper()
	ans, err := from.Ask(netip.AddrPortFrom(to, port))
	if err != nil {
		t.Fatalf("%s -> %s: %v", from.Name, netip.AddrPortFrom(to, port), err)
	}
	return ans
}
