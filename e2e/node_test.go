// SPDX-License-Identifier: Apache-2.0

package e2e_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	types100 "github.com/containernetworking/cni/pkg/types/100"

	"github.com/mtlsbridge/mtlsbridge/bpf"
	"github.com/mtlsbridge/mtlsbridge/internal/cnitest"
	"github.com/mtlsbridge/mtlsbridge/internal/manifesttest"
	"github.com/mtlsbridge/mtlsbridge/internal/netnstest"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/bypass"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/redirect"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// Bounds of every wait in these tests.
const (
	addTimeout  = 60 * time.Second // one pod's start, through all its retries
	waitTimeout = 30 * time.Second
	serverPort  = 8080
	// maxAddrs pods' sandboxes get addresses, never reused.
	maxAddrs = 150
)

// node is node-a of a two-node topology with everything the test plays: the
// API (a manifest folder), the container runtime (libcni running ptp with
// static IPAM, then mtlsbridge-cni), the node's mTLS agent pod (a
// transparent listener answering "agent") and the mtlsbridge agent as a
// process that the test starts and kills. Node-b has pod r, answering "r".
type node struct {
	t          testing.TB
	bin        string
	node, peer *netnstest.Node
	r          *netnstest.Pod
	runtime    *cnitest.Runtime
	capture    *netnstest.Capture

	manifests, stateDir, bpfRoot, logFile string

	mu    sync.Mutex
	agent *agentProcess
	// started is when an agent process was first started.
	started time.Time

	// Addresses handed out so far, never reused: a captured segment names
	// its pod by its source address.
	nextIP   atomic.Int32
	enrolled sync.Map // netip.Addr -> pod name
	plain    sync.Map // the same, for pods not enrolled
}

func newNode(t testing.TB) *node {
	netnstest.RequirePrivileged(t)
	n := &node{t: t, bin: cnitest.Binaries(t), manifests: t.TempDir(), bpfRoot: netnstest.BPFRoot(t),
		logFile: filepath.Join(t.TempDir(), "agent.log")}
	stateDir, err := os.MkdirTemp("", "mtlsbridge-") // short: UNIX socket paths
	must(t, err)
	t.Cleanup(func() { os.RemoveAll(stateDir) })
	n.stateDir = stateDir
	must(t, os.WriteFile(filepath.Join(stateDir, "tokens"), []byte("tok-a kube-system/ztunnel\n"), 0o600))

	n.node, n.peer = netnstest.NewNodes(t)
	n.r = n.peer.AddPod(t, "r")
	n.r.Serve(t, "r", serverPort, false, n.r.IP4, n.r.IP6)
	ztunnel := n.node.AddPod(t, "ztunnel")
	ztunnel.MakeAgent(t)
	ztunnel.Serve(t, "agent", serverPort, true, netip.IPv4Unspecified(), netip.IPv6Unspecified())

	n.writeManifest("cluster.yaml", fmt.Sprintf(`apiVersion: v1
kind: Node
metadata: {name: node-a}
status: {addresses: [{type: InternalIP, address: %s}]}
---
apiVersion: v1
kind: Namespace
metadata: {name: app}
---
apiVersion: v1
kind: Pod
metadata: {name: ztunnel, namespace: kube-system, labels: {%s: %s}}
spec: {nodeName: node-a}
status: {phase: Running, podIPs: [{ip: %s}, {ip: %q}]}
`, n.node.Addr4, tables.RedirTypeLabel, tables.RedirTypeProxy, ztunnel.IP4, ztunnel.IP6))

	n.runtime = cnitest.NewRuntime(t, n.node.NS, n.bin, func(sb cnitest.Sandbox) []byte {
		return fmt.Appendf(nil, `{"cniVersion": "1.0.0", "name": "node", "plugins": [
  {"type": "ptp", "ipMasq": false, "mtu": 1500,
   "ipam": {"type": "static", "addresses": %s, "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0"}]}},
  {"type": "mtlsbridge-cni", "stateDir": %q, "waitTimeout": "5s"}]}`, sb.StaticAddresses(), n.stateDir)
	})
	// From here on, every TCP segment on node-a's uplink is recorded.
	n.capture = n.node.Capture(t, netnstest.UplinkName)
	t.Cleanup(func() {
		n.kill()
		if t.Failed() {
			b, _ := os.ReadFile(n.logFile)
			t.Logf("agent log (last 64 KiB):\n%s", b[max(0, len(b)-64<<10):])
		}
	})
	return n
}

func (n *node) writeManifest(name, content string) {
	must(n.t, manifesttest.Write(n.manifests, name, []byte(content)))
}

// agentProcess is one run of `mtlsbridge agent`.
type agentProcess struct {
	cmd  *exec.Cmd
	done chan struct{}
}

// start runs a new agent process for node-a, unless one runs.
func (n *node) start() {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.agent != nil {
		return
	}
	log, err := os.OpenFile(n.logFile, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	must(n.t, err)
	defer log.Close()
	fmt.Fprintf(log, "=== agent started at %s\n", time.Now().Format(time.RFC3339Nano))
	cmd := exec.Command(filepath.Join(n.bin, "mtlsbridge"), "agent",
		"--source=dir:"+n.manifests, "--node-name=node-a", "--state-dir="+n.stateDir,
		"--bpf-root="+filepath.Join(n.bpfRoot, "agent"), "--node-netns=/run/netns/"+n.node.Name,
		"--devices="+netnstest.UplinkName, "--grpc-listen=127.0.0.1:0",
		"--token-file="+filepath.Join(n.stateDir, "tokens"), "--bypass-check-interval=1s")
	cmd.Stdout, cmd.Stderr = log, log
	must(n.t, cmd.Start())
	p := &agentProcess{cmd: cmd, done: make(chan struct{})}
	go func() { cmd.Wait(); close(p.done) }()
	n.agent = p
	if n.started.IsZero() {
		n.started = time.Now()
	}
}

// kill stops the running agent with SIGKILL: no stop hook runs.
func (n *node) kill() {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.agent == nil {
		return
	}
	n.agent.cmd.Process.Signal(syscall.SIGKILL)
	<-n.agent.done
	n.agent = nil
}

func (n *node) firstStart() time.Time {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.started
}

// pod is one pod of node-a as the kubelet runs it.
type pod struct {
	name     string
	enrolled bool
	uid      string
	ns       *netnstest.NS
	sb       cnitest.Sandbox
	ip4, ip6 netip.Addr
}

// newPod creates the pod in the API (no address yet, as before its
// sandbox exists) and a network namespace for its sandbox.
func (n *node) newPod(name string, enrolled bool) *pod {
	p := &pod{name: name, enrolled: enrolled, ns: netnstest.NewNS(n.t, "mtlsb-"+name)}
	// eth0 usable at once (no IPv6 duplicate address detection).
	p.ns.Sysctl(n.t, "ipv6/conf/default/accept_dad", "0")
	p.sb = cnitest.NewSandbox(p.ns, "app", name)
	p.uid = p.sb.UID
	n.assignAddrs(p)
	n.writePod(p, false)
	return p
}

// assignAddrs gives the pod fresh addresses for its next sandbox.
func (n *node) assignAddrs(p *pod) {
	i := n.nextIP.Add(1)
	if i > maxAddrs {
		panic("out of pod addresses: a test starts too many pods") // a bug of the test
	}
	// Node-b routes 10.1.0.0/24 and fd00:1::/64 to node-a; netnstest's
	// pods use the low addresses.
	p.ip4 = netip.AddrFrom4([4]byte{10, 1, 0, byte(100 + i)})
	p.ip6 = netip.MustParseAddr(fmt.Sprintf("fd00:1::1:%x", i))
	p.sb.Addrs = []netip.Prefix{netip.PrefixFrom(p.ip4, 24), netip.PrefixFrom(p.ip6, 64)}
	p.sb.Gateways = []netip.Addr{netip.MustParseAddr("10.1.0.1"), netip.MustParseAddr("fd00:1::1")}
	set := &n.plain
	if p.enrolled {
		set = &n.enrolled
	}
	set.Store(p.ip4, p.name)
	set.Store(p.ip6, p.name)
}

// writePod writes the pod's object, with its addresses once the kubelet
// knows them.
func (n *node) writePod(p *pod, withIPs bool) {
	labels := ""
	if p.enrolled {
		labels = tables.RedirTypeLabel + ": " + tables.RedirTypeWorkload
	}
	status := "{phase: Pending}"
	if withIPs {
		status = fmt.Sprintf("{phase: Running, podIPs: [{ip: %s}, {ip: %q}]}", p.ip4, p.ip6)
	}
	n.writeManifest("pod-"+p.name+".yaml", fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata: {name: %s, namespace: app, uid: %s, labels: {%s}}
spec: {nodeName: node-a}
status: %s
`, p.name, p.uid, labels, status))
}

func (n *node) deletePod(p *pod) {
	if err := os.Remove(filepath.Join(n.manifests, "pod-"+p.name+".yaml")); err != nil && !errors.Is(err, os.ErrNotExist) {
		n.t.Error(err)
	}
}

// startSandbox plays the runtime and the kubelet until the pod's ADD
// succeeds: a failed ADD is torn down (DEL) and retried with a new
// sandbox id. It returns the host side of the pod's veth and the number of
// failed attempts. For an enrolled pod it checks, at the moment the pod
// may start, that the pinned map already steers every address of the pod
// to that interface: the pod never runs unsteered.
func (n *node) startSandbox(ctx context.Context, p *pod) (hostIf string, failures int, err error) {
	ctx, cancel := context.WithTimeout(ctx, addTimeout)
	defer cancel()
	for {
		var res *types100.Result
		res, err = n.runtime.Add(ctx, p.sb)
		if err == nil {
			hostIf = hostSide(res)
			break
		}
		failures++
		n.runtime.Del(context.Background(), p.sb)
		select {
		case <-ctx.Done():
			return "", failures, fmt.Errorf("pod %s did not start: %w (last: %v)", p.name, ctx.Err(), err)
		case <-time.After(time.Duration(100+rand.IntN(200)) * time.Millisecond):
		}
		p.sb.ContainerID = newContainerID(p)
	}
	if n.firstStart().IsZero() {
		return hostIf, failures, fmt.Errorf("pod %s started before any agent ran", p.name)
	}
	if p.enrolled {
		if err := n.checkSteered(p, hostIf); err != nil {
			return hostIf, failures, err
		}
	}
	return hostIf, failures, nil
}

// newContainerID is the id of the pod's next sandbox.
func newContainerID(p *pod) string { return cnitest.NewSandbox(p.ns, "app", p.name).ContainerID }

func hostSide(res *types100.Result) string {
	for _, i := range res.Interfaces {
		if i.Sandbox == "" {
			return i.Name
		}
	}
	return ""
}

// checkSteered reads the pinned state: the from-pod program is first on
// the pod's interface, and each address of the pod has an enrolled entry
// for that interface in the redirect map.
func (n *node) checkSteered(p *pod, hostIf string) error {
	link, err := n.node.Netlink(n.t).LinkByName(hostIf)
	if err != nil {
		return fmt.Errorf("pod %s: its interface %q: %w", p.name, hostIf, err)
	}
	var prog bpf.LinkInfo
	if err := n.node.Do(func() (err error) {
		prog, err = bpf.PinnedLink(redirect.LinkPin(filepath.Join(n.bpfRoot, "agent"), hostIf))
		return err
	}); err != nil || prog.Ifindex != link.Attrs().Index || !prog.First {
		return fmt.Errorf("pod %s started without the from-pod program first on %s: %+v, %v", p.name, hostIf, prog, err)
	}
	m, err := ebpf.LoadPinnedMap(filepath.Join(n.bpfRoot, "agent", bpf.MapName), &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		return fmt.Errorf("pod %s started, but no pinned map: %w", p.name, err)
	}
	defer m.Close()
	entries, err := bpf.NewRedirectMap(m).Dump()
	if err != nil {
		return err
	}
	for _, ip := range []netip.Addr{p.ip4, p.ip6} {
		e, ok := entries[ip]
		if !ok || e.Kind != bpf.KindEnrolled || int(e.Ifindex) != link.Attrs().Index {
			return fmt.Errorf("pod %s started while %s was not steered to %s(%d): entry %+v (present %v)",
				p.name, ip, hostIf, link.Attrs().Index, e, ok)
		}
	}
	return nil
}

// traffic counts what the pods' applications saw.
type traffic struct {
	sent, agent, direct, failed atomic.Int64
}

// run is the pod's application: until stop, it connects to r, sends a
// payload and reads who answered; enrolled pods must be answered by the
// mTLS agent. Bounded by stop and by a count.
func (n *node) run(p *pod, stop <-chan struct{}, tr *traffic) {
	payload := []byte("payload from " + p.name + "\n")
	for i := 0; i < 10_000; i++ {
		for _, dst := range []netip.Addr{n.r.IP4, n.r.IP6} {
			select {
			case <-stop:
				return
			default:
			}
			tr.sent.Add(1)
			ans, err := p.ns.Send(netip.AddrPortFrom(dst, serverPort), payload)
			switch {
			case err != nil:
				tr.failed.Add(1)
			case ans.Server == "agent":
				tr.agent.Add(1)
				if !p.enrolled {
					n.t.Errorf("pod %s is not enrolled, but the agent answered: %s", p.name, ans)
				}
			default:
				tr.direct.Add(1)
				if p.enrolled {
					n.t.Errorf("enrolled pod %s reached %s directly: %s", p.name, dst, ans)
				}
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// leaks returns the captured segments from an enrolled pod's address (the
// issue asks for no payload; the datapath lets not even a SYN out), and the
// number carrying payload from other pods, which shows that the capture
// sees pod traffic at all.
func (n *node) leaks() (leaked []netnstest.Segment, plainPayload int) {
	for _, s := range n.capture.Segments() {
		if _, ok := n.enrolled.Load(s.Src.Addr()); ok {
			leaked = append(leaked, s)
		}
		if _, ok := n.plain.Load(s.Src.Addr()); ok && s.Payload > 0 {
			plainPayload++
		}
	}
	return leaked, plainPayload
}

// payload counts the segments that carry payload.
func payload(segments []netnstest.Segment) int {
	c := 0
	for _, s := range segments {
		if s.Payload > 0 {
			c++
		}
	}
	return c
}

// checkBypass runs `mtlsbridge bypass -o json` and returns the pods it
// checked (names in namespace app) and the gaps in the kernel of each pod
// that has some. The xDS gap is left aside: no mTLS agent speaks xDS here.
func (n *node) checkBypass() (checked []string, gaps map[string][]string, err error) {
	cmd := exec.Command(filepath.Join(n.bin, "mtlsbridge"), "bypass", "-o", "json", "--state-dir="+n.stateDir)
	var out, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &stderr
	cmd.Run() // exit 1 with the xDS gap: the report says why
	var rep bypass.Report
	if err := json.Unmarshal(out.Bytes(), &rep); err != nil {
		return nil, nil, fmt.Errorf("mtlsbridge bypass: %v: %s %s", err, out.String(), stderr.String())
	}
	gaps = map[string][]string{}
	for _, row := range rep.Pods {
		checked = append(checked, strings.TrimPrefix(row.Pod, "app/"))
		if g := slices.DeleteFunc(slices.Clone(row.Gaps), func(g string) bool { return g == bypass.GapNotAcked }); len(g) > 0 {
			gaps[row.Pod] = g
		}
	}
	slices.Sort(checked)
	return checked, gaps, nil
}

// waitNoBypass waits until the bypass check finds the enrolled pods, and
// only them, without a gap in the kernel.
func (n *node) waitNoBypass(want []string) {
	n.t.Helper()
	deadline := time.Now().Add(waitTimeout)
	var last string
	for time.Now().Before(deadline) {
		checked, gaps, err := n.checkBypass()
		if err == nil && len(gaps) == 0 && slices.Equal(checked, want) {
			return
		}
		last = fmt.Sprintf("checked %v (want %v), gaps %v, error %v", checked, want, gaps, err)
		time.Sleep(200 * time.Millisecond)
	}
	n.t.Fatalf("enrolled pods not all redirected: %s", last)
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
