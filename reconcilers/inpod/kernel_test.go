// SPDX-License-Identifier: Apache-2.0

package inpod_test

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
	"istio.io/istio/pkg/zdsapi"

	"github.com/mtlsbridge/mtlsbridge/internal/manifesttest"
	"github.com/mtlsbridge/mtlsbridge/internal/netnstest"
	"github.com/mtlsbridge/mtlsbridge/metrics"
	"github.com/mtlsbridge/mtlsbridge/nodenetns"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/enrollment"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/inpod"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/readiness"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/steering"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/steering/steeringtest"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/workload"
	"github.com/mtlsbridge/mtlsbridge/tables"
	"github.com/mtlsbridge/mtlsbridge/tables/ingest"
	"github.com/mtlsbridge/mtlsbridge/zds"
)

// TestKernel runs the in-pod mode on a real pod's namespace with a real
// ZDS client: the namespace ztunnel is handed is the pod's (a listener it
// opens there receives the pod's outbound TCP), the redirection outlives
// an agent restart without a gap and is taken over, and an agent started
// in the l2 mode removes it.
func TestKernel(t *testing.T) {
	netnstest.RequirePrivileged(t)
	n1, n2 := netnstest.NewNodes(t)
	a := n1.AddPod(t, "a")
	r := n2.AddPod(t, "r")
	r.Serve(t, "r", 8080, false, r.IP4, r.IP6)
	a.Serve(t, "a", 8080, false, a.IP4, a.IP6)
	manifests := t.TempDir()
	path := "/var/run/netns/" + a.NS.Name
	must(t, manifesttest.Write(manifests, "cluster.yaml", clusterOf(a)))
	report := &tables.CNIPod{ContainerID: "sandbox-a", Pod: "app/a", UID: "a-1", IPs: []netip.Addr{a.IP4, a.IP6},
		Netns: path, State: tables.CNIStateWaiting, Updated: time.Now()}

	socket := startZtunnel(t)

	// The agent in the in-pod mode.
	ag := startAgent(t, n1, manifests, report, "--redirect-mode=inpod", "--zds-socket="+socket, "--probe-snat")
	ag.waitSteered(t, "app/a", a.IP4, a.IP6)
	expectRules(t, a, "in place")
	for _, dst := range []netip.Addr{r.IP4, r.IP6} {
		if got, err := a.Ask(netip.AddrPortFrom(dst, 8080)); err != nil || got.Server != "ztunnel-a-1" {
			t.Errorf("a -> %s: %v %v, want ztunnel's listener in a's namespace", dst, got, err)
		}
	}
	// The node's own connections (the kubelet's probes) reach a itself,
	// from the probe address, not ztunnel's plain inbound listener.
	expectProbes(t, n1, a, "the in-pod mode")

	// Restart: the redirection stays while no agent runs, and the new
	// agent takes it over; ztunnel gets a snapshot again.
	ag.stop(t)
	expectRules(t, a, "in place")
	if got, err := a.Ask(netip.AddrPortFrom(r.IP4, 8080)); err != nil || got.Server != "ztunnel-a-1" {
		t.Errorf("while no agent runs, a -> r: %v %v, want ztunnel", got, err)
	}
	expectProbes(t, n1, a, "no agent")
	ag = startAgent(t, n1, manifests, report, "--redirect-mode=inpod", "--zds-socket="+socket, "--probe-snat")
	ag.waitSteered(t, "app/a", a.IP4, a.IP6)
	expectRules(t, a, "in place")
	expectProbes(t, n1, a, "the agent restarted")
	ag.stop(t)

	// The mode turned off: nothing of it stays in the pod.
	startAgent(t, n1, manifests, report, "--redirect-mode=l2")
	deadline := time.Now().Add(waitTimeout)
	for {
		gaps := rulesGaps(t, a)
		if strings.HasPrefix(gaps, inpod.GapTableMissing) && strings.Contains(gaps, inpod.GapRuleMissing+" (IPv4)") &&
			strings.Contains(gaps, inpod.GapRuleMissing+" (IPv6)") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the l2 mode left in-pod rules: gaps only %q", gaps)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if got, err := a.Ask(netip.AddrPortFrom(r.IP4, 8080)); err != nil || got.Server != "r" {
		t.Errorf("after the in-pod mode, a -> r: %v %v, want r directly", got, err)
	}
}

// expectProbes waits until the node's connections to p reach p itself,
// from the probe addresses.
func expectProbes(t *testing.T, node *netnstest.Node, p *netnstest.Pod, when string) {
	t.Helper()
	deadline := time.Now().Add(waitTimeout)
	for i, probe := range []netip.Addr{inpod.ProbeSNAT4, inpod.ProbeSNAT6} {
		dst := netip.AddrPortFrom([]netip.Addr{p.IP4, p.IP6}[i], 8080)
		for {
			got, err := node.Ask(dst)
			if err == nil && got.Server == p.Name && got.Remote.Addr() == probe {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: node -> %s: %v %v, want %s from %s", when, dst, got, err, p.Name, probe)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
}

// TestKernelFindsUnreportedNetns: an enrolled pod that no CNI report
// names (it started before mtlsbridge-cni was chained) is found in the
// runtime's folder of namespaces by its addresses, among a plain pod's
// namespace, a node's, and a file that is none, and redirected there; its
// namespace pinned twice is still one.
func TestKernelFindsUnreportedNetns(t *testing.T) {
	netnstest.RequirePrivileged(t)
	n1, n2 := netnstest.NewNodes(t)
	a := n1.AddPod(t, "a")
	plain := n1.AddPod(t, "plain")
	r := n2.AddPod(t, "r")
	r.Serve(t, "r", 8080, false, r.IP4, r.IP6)
	folder := t.TempDir()
	for _, ns := range []*netnstest.NS{a.NS, plain.NS, n1.NS} {
		ns.Pin(t, filepath.Join(folder, ns.Name))
	}
	a.NS.Pin(t, filepath.Join(folder, "again-"+a.NS.Name))
	must(t, os.WriteFile(filepath.Join(folder, "not-a-netns"), nil, 0o600))

	manifests := t.TempDir()
	must(t, manifesttest.Write(manifests, "cluster.yaml", clusterOf(a, plain)))

	socket := startZtunnel(t)

	ag := startAgent(t, n1, manifests, nil, "--redirect-mode=inpod", "--zds-socket="+socket, "--netns-dir="+folder)
	ag.waitSteered(t, "app/a", a.IP4, a.IP6)
	expectRules(t, a, "in place")
	for _, dst := range []netip.Addr{r.IP4, r.IP6} {
		if got, err := a.Ask(netip.AddrPortFrom(dst, 8080)); err != nil || got.Server != "ztunnel-a-1" {
			t.Errorf("a -> %s: %v %v, want ztunnel's listener in a's namespace", dst, got, err)
		}
	}
	if gaps := rulesGaps(t, plain); !strings.HasPrefix(gaps, inpod.GapTableMissing) {
		t.Errorf("the plain pod's namespace: gaps %q, want no redirection", gaps)
	}
	var found []string
	for row := range ag.cniPods.All(ag.db.ReadTxn()) {
		found = append(found, fmt.Sprintf("%s %s %s %s", row.Pod, row.UID, filepath.Dir(row.Netns), row.State))
	}
	if want := fmt.Sprintf("app/a a-1 %s %s", folder, tables.CNIStateFound); len(found) != 1 || found[0] != want {
		t.Errorf("cni-pods: %q, want one row %q", found, want)
	}
}

// TestNamespaces: the listing of a folder of pinned namespaces gives each
// pod's namespace once per pin with its identity, addresses and since
// when it exists, and passes over the agent's own namespace (the node's)
// and a file that is none, without an error.
func TestNamespaces(t *testing.T) {
	netnstest.RequirePrivileged(t)
	n1, _ := netnstest.NewNodes(t)
	// The kernel stamps times on a coarse tick.
	created := time.Now().Add(-time.Second)
	a := n1.AddPod(t, "a")
	folder := t.TempDir()
	a.NS.Pin(t, filepath.Join(folder, "a"))
	own := filepath.Join(folder, "own")
	must(t, os.WriteFile(own, nil, 0o600))
	must(t, unix.Mount("/proc/self/ns/net", own, "", unix.MS_BIND, ""))
	t.Cleanup(func() { unix.Unmount(own, unix.MNT_DETACH) })
	must(t, os.WriteFile(filepath.Join(folder, "not-a-netns"), nil, 0o600))

	target := inpod.NetlinkTargetForTests()
	namespaces, errs := target.Namespaces(folder)
	if len(errs) > 0 {
		t.Errorf("errors: %v", errs)
	}
	id, err := target.Identify("/var/run/netns/" + a.NS.Name)
	must(t, err)
	var got []string
	for _, ns := range namespaces {
		// Without the link-local addresses the kernel adds in its time.
		ips := slices.DeleteFunc(slices.Clone(ns.IPs), netip.Addr.IsLinkLocalUnicast)
		slices.SortFunc(ips, netip.Addr.Compare)
		got = append(got, fmt.Sprintf("%s same:%v %v", filepath.Base(ns.Path), ns.ID == id, ips))
	}
	if want := fmt.Sprintf("a same:true [%s 127.0.0.1 ::1 %s]", a.IP4, a.IP6); !slices.Equal(got, []string{want}) {
		t.Errorf("listed %q, want only %q", got, want)
	}
	// Since when it exists: made by this test.
	if len(namespaces) == 1 && (namespaces[0].ExistsSince.Before(created) || namespaces[0].ExistsSince.After(time.Now())) {
		t.Errorf("a's namespace exists since %v, want between %v and now", namespaces[0].ExistsSince, created)
	}
}

// clusterOf is the API of namespace app with the pods on node-a, the
// first enrolled (label cilium.io/redir-type=workload), the others not;
// pod NAME's uid is NAME-1.
func clusterOf(enrolled *netnstest.Pod, plain ...*netnstest.Pod) []byte {
	b := []byte("apiVersion: v1\nkind: Namespace\nmetadata: {name: app}\n")
	for i, p := range append([]*netnstest.Pod{enrolled}, plain...) {
		labels := ""
		if i == 0 {
			labels = ", labels: {cilium.io/redir-type: workload}"
		}
		b = fmt.Appendf(b, `---
apiVersion: v1
kind: Pod
metadata: {name: %s, namespace: app, uid: %s-1%s}
spec: {nodeName: node-a}
status: {phase: Running, podIPs: [{ip: %s}, {ip: %q}]}
`, p.Name, p.Name, labels, p.IP4, p.IP6)
	}
	return b
}

// startZtunnel runs a ZDS client as ztunnel (netnsZtunnel) on a socket
// the agent is to serve, and returns the socket's path.
func startZtunnel(t *testing.T) string {
	// Short: UNIX socket paths are limited to 108 bytes.
	dir, err := os.MkdirTemp("", "inpod-")
	must(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	socket := filepath.Join(dir, "ztunnel.sock")
	z := &netnsZtunnel{listeners: map[string][]net.Listener{}}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- (&zds.Client{Path: socket, Handler: z, Log: slog.New(slog.DiscardHandler), MaxBackoff: 50 * time.Millisecond}).Run(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("ztunnel: %v", err)
		}
		z.closeAll()
	})
	return socket
}

const waitTimeout = 20 * time.Second

// testAgent is a hive of the in-pod mode on the real kernel.
type testAgent struct {
	h       *hive.Hive
	db      *statedb.DB
	cniPods statedb.Table[*tables.CNIPod]
	modes   steering.Modes
}

// startAgent starts the agent; the CNI report comes back from the state
// folder as package cni does, before cni-pods counts as initialized.
func startAgent(t *testing.T, node *netnstest.Node, manifests string, report *tables.CNIPod, flags ...string) *testAgent {
	ag := &testAgent{}
	l2 := steeringtest.New(steering.ModeL2)
	l2.SteerAll()
	h := hive.New(
		cell.SimpleHealthCell, job.Cell, statedb.Cell,
		metrics.Cell, nodenetns.Cell, tables.Cell, ingest.Cell, enrollment.Cell, steering.Cell, readiness.Cell, workload.Cell,
		// In the l2 mode, every pod is steered at once.
		cell.Provide(l2.Out, inpod.TableReportsForTests),
		inpod.Cell,
		cell.Invoke(func(db *statedb.DB, cniPods statedb.RWTable[*tables.CNIPod], m steering.Modes) {
			ag.db, ag.cniPods, ag.modes = db, cniPods, m
			wtxn := db.WriteTxn(cniPods)
			done := cniPods.RegisterInitializer(wtxn, "test-restore")
			if report != nil {
				cniPods.Insert(wtxn, report)
			}
			done(wtxn)
			wtxn.Commit()
		}),
	)
	fs := pflag.NewFlagSet("", pflag.ContinueOnError)
	h.RegisterFlags(fs)
	// The host's namespaces are never searched (flags may name a folder).
	must(t, fs.Parse(append([]string{"--source=dir:" + manifests, "--node-name=node-a", "--node-netns=/var/run/netns/" + node.Name,
		"--netns-dir=" + t.TempDir(), "--netns-search-min-age=0s"}, flags...)))
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	must(t, h.Start(hivetest.Logger(t), ctx))
	ag.h = h
	t.Cleanup(func() { ag.stop(t) })
	return ag
}

func (ag *testAgent) stop(t *testing.T) {
	if ag.h == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	must(t, ag.h.Stop(hivetest.Logger(t), ctx))
	ag.h = nil
}

func (ag *testAgent) waitSteered(t *testing.T, pod string, addrs ...netip.Addr) {
	t.Helper()
	mode, err := ag.modes.Active()
	must(t, err)
	deadline := time.Now().Add(waitTimeout)
	for {
		state, detail := mode.Steering(ag.db.ReadTxn(), pod, steering.Sandbox{IPs: addrs})
		if state == steering.Steered {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s not steered: %s: %s", pod, state, detail)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func rulesGaps(t *testing.T, p *netnstest.Pod) string {
	gaps, err := inpodCheck(p)
	must(t, err)
	return strings.Join(gaps, "; ")
}

func expectRules(t *testing.T, p *netnstest.Pod, what string) {
	t.Helper()
	if gaps := rulesGaps(t, p); gaps != "" {
		t.Errorf("rules %s: %s", what, gaps)
	}
}

// inpodCheck is the bypass check's reading of a namespace.
func inpodCheck(p *netnstest.Pod) ([]string, error) {
	return inpod.NetlinkTargetForTests().Check("/var/run/netns/"+p.NS.Name, []netip.Addr{p.IP4, p.IP6})
}

// netnsZtunnel opens listeners on ztunnel's ports in each namespace it is
// handed, as ztunnel does, answering "ztunnel-UID".
type netnsZtunnel struct {
	mu        sync.Mutex
	listeners map[string][]net.Listener
}

func (z *netnsZtunnel) Add(uid string, _ *zdsapi.WorkloadInfo, f *os.File) error {
	defer f.Close()
	z.mu.Lock()
	defer z.mu.Unlock()
	if _, ok := z.listeners[uid]; ok {
		return nil
	}
	var ls []net.Listener
	for _, addr := range []string{"0.0.0.0:15001", "[::]:15001", "0.0.0.0:15006", "[::]:15006", "0.0.0.0:15008", "[::]:15008"} {
		l, err := listenIn(netns.NsHandle(f.Fd()), addr)
		if err != nil {
			return err
		}
		ls = append(ls, l)
		go func() {
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				fmt.Fprintf(c, "ztunnel-%s %s %s\n", uid, c.LocalAddr(), c.RemoteAddr())
				c.Close()
			}
		}()
	}
	z.listeners[uid] = ls
	return nil
}

func (z *netnsZtunnel) Del(uid string) {
	z.mu.Lock()
	defer z.mu.Unlock()
	for _, l := range z.listeners[uid] {
		l.Close()
	}
	delete(z.listeners, uid)
}

func (z *netnsZtunnel) Reconcile(keep map[string]bool) {
	z.mu.Lock()
	var gone []string
	for uid := range z.listeners {
		if !keep[uid] {
			gone = append(gone, uid)
		}
	}
	z.mu.Unlock()
	for _, uid := range gone {
		z.Del(uid)
	}
}

func (z *netnsZtunnel) closeAll() { z.Reconcile(nil) }

// listenIn opens a TCP listener inside the namespace h.
func listenIn(h netns.NsHandle, addr string) (net.Listener, error) {
	type result struct {
		l   net.Listener
		err error
	}
	res := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			res <- result{err: err}
			return
		}
		defer orig.Close()
		if err := unix.Setns(int(h), unix.CLONE_NEWNET); err != nil {
			res <- result{err: err}
			return
		}
		network := "tcp4"
		if strings.HasPrefix(addr, "[") {
			network = "tcp6"
		}
		l, err := net.Listen(network, addr)
		if err := netns.Set(orig); err != nil {
			res <- result{l, err}
			return // the thread stays locked and dies with the goroutine
		}
		runtime.UnlockOSThread()
		res <- result{l, err}
	}()
	r := <-res
	return r.l, r.err
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
