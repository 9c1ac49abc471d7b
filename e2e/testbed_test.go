// SPDX-License-Identifier: Apache-2.0

package e2e_test

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/mtlsbridge/mtlsbridge/identity"
	"github.com/mtlsbridge/mtlsbridge/internal/cnitest"
	"github.com/mtlsbridge/mtlsbridge/internal/manifesttest"
	"github.com/mtlsbridge/mtlsbridge/internal/netnstest"
	"github.com/mtlsbridge/mtlsbridge/proxy"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// The two-node testbed of the mTLS proofs: nodes node-a and node-b are
// network namespaces joined by an underlay (a veth pair between their
// uplinks). On each, the built node agent runs inside the node's
// namespace (nsenter --net, keeping the mount namespace and so bpffs), as
// a hostNetwork DaemonSet does, with its real BPF datapath on the uplink
// and on pods' interfaces and its gRPC listener on the node's own address;
// the built mtlsbridge-proxy runs inside its own pod (labelled
// cilium.io/redir-type=proxy), configured as ztunnel is, reaching that
// listener. Pods start through the CNI chain (ptp, static IPAM,
// mtlsbridge-cni). Both agents share one CA folder and one cluster state:
// a manifest folder, or one real kube-apiserver (cluster).
//
// Addresses: node i has pods in 10.i.0.0/24 and fd00:i::/64 (gateways
// .1), its proxy pod at .2, other pods from .20 on.

// Bounds of the testbed's waits and of one request.
const (
	bedTimeout     = 30 * time.Second
	requestTimeout = 5 * time.Second
	// Ports of the pods' servers: digest answers once the client has sent
	// everything; echo echoes lines.
	digestPort = 8080
	echoPort   = 8081
	// maxPayload bounds what a digest server reads.
	maxPayload = 64 << 20
)

type bed struct {
	t       testing.TB
	bin     string
	caDir   string
	cluster cluster
	nodes   [2]*bedNode
	// underlay records node-a's uplink: everything between the nodes
	// (in a tunnel routing mode: node-a's tunnel device, and uplink
	// records the uplink).
	underlay, uplink *netnstest.Capture
}

// bedNode is one node and what runs on it.
type bedNode struct {
	bed      *bed
	name     string
	index    int
	ns       *netnstest.Node
	stateDir string
	bpfRoot  string
	runtime  *cnitest.Runtime
	proxyPod *bedPod
	// tokenPath is the proxy's bearer token file.
	tokenPath string
	// grpc is the agent's listener on the node's address.
	grpc string
	// zdsSocket is where the proxy meets the agent in the in-pod mode
	// (ztunnel's INPOD_UDS, a host folder both mount).
	zdsSocket string
	// netnsDir is where the runtime pins the node's pods' namespaces
	// (the agent's --netns-dir): the node's own /var/run/netns.
	netnsDir string
	// inPod runs the agent with --redirect-mode=inpod and the proxy as
	// ztunnel in its in-pod mode (inpod_test.go); read at their start, so
	// that a node may switch modes (modeswitch_test.go).
	inPod bool

	mu           sync.Mutex
	agent, proxy *proc
	nextAddr     int
}

// bedPod is a pod as the kubelet and runtime run it.
type bedPod struct {
	name, namespace, serviceAccount string
	node                            *bedNode
	enrolled, isProxy               bool
	ns                              *netnstest.NS
	sb                              cnitest.Sandbox
	ip4, ip6                        netip.Addr
	// running: its addresses are in the API (after ADD, as the kubelet).
	running bool
	// published: folder mode, the redirect ready annotation is written.
	published bool
	// created: the pod exists in the cluster.
	created bool
}

func (p *bedPod) String() string { return p.name }

// identity is the pod's SPIFFE ID.
func (p *bedPod) identity() string {
	return "spiffe://cluster.local/ns/" + p.namespace + "/sa/" + p.serviceAccount
}

func (p *bedPod) addr(v6 bool) netip.Addr {
	if v6 {
		return p.ip6
	}
	return p.ip4
}

// proc is a process of the testbed (agent or proxy).
type proc struct {
	cmd  *exec.Cmd
	done chan struct{}
}

// newBed brings the testbed up: nodes, CA, cluster state, agents, proxy
// pods through CNI, proxies ready, and a capture on the underlay.
func newBed(t testing.TB, c cluster) *bed { return newBedWith(t, c, bedConfig{}) }

// bedConfig chooses how the testbed runs; the zero value is the l2 mode
// with native routing.
type bedConfig struct {
	// inPod: the in-pod mode (bedNode.inPod).
	inPod bool
	// tunnel: Cilium's tunnel routing mode with this protocol. The
	// underlay capture is then node-a's tunnel device (every pod's packet
	// between the nodes, decapsulated); uplink records node-a's uplink.
	tunnel netnstest.Tunnel
	// overWireGuard: the tunnel's packets cross cilium_wg0
	// (netnstest.NewTunnelNodesOverWireGuard).
	overWireGuard bool
}

// newBedWith is newBed as cfg says.
func newBedWith(t testing.TB, c cluster, cfg bedConfig) *bed {
	netnstest.RequirePrivileged(t)
	b := &bed{t: t, bin: cnitest.Binaries(t), cluster: c}
	b.caDir = t.TempDir()
	certPEM, keyPEM, err := identity.NewRootMaterial("cluster.local", 24*time.Hour)
	must(t, err)
	must(t, os.WriteFile(filepath.Join(b.caDir, identity.CACertFile), certPEM, 0o600))
	must(t, os.WriteFile(filepath.Join(b.caDir, identity.CAKeyFile), keyPEM, 0o600))

	var na, nb *netnstest.Node
	if cfg.overWireGuard {
		na, nb = netnstest.NewTunnelNodesOverWireGuard(t, cfg.tunnel)
	} else if cfg.tunnel != "" {
		na, nb = netnstest.NewTunnelNodes(t, cfg.tunnel)
	} else {
		na, nb = netnstest.NewNodes(t)
	}
	bpf := netnstest.BPFRoot(t)
	for i, ns := range []*netnstest.Node{na, nb} {
		stateDir, err := os.MkdirTemp("", "mtlsb-") // short: UNIX socket paths
		must(t, err)
		t.Cleanup(func() { os.RemoveAll(stateDir) })
		n := &bedNode{bed: b, name: "node-" + string(rune('a'+i)), index: i + 1, ns: ns, stateDir: stateDir,
			bpfRoot: filepath.Join(bpf, "node-"+string(rune('a'+i))), grpc: netip.AddrPortFrom(ns.Addr4, 15012).String(),
			nextAddr: 20, zdsSocket: filepath.Join(stateDir+"-zds", "ztunnel.sock"), netnsDir: t.TempDir(), inPod: cfg.inPod}
		t.Cleanup(func() { os.RemoveAll(stateDir + "-zds") })
		n.runtime = cnitest.NewRuntime(t, ns.NS, b.bin, func(sb cnitest.Sandbox) []byte {
			return fmt.Appendf(nil, `{"cniVersion": "1.0.0", "name": "node", "plugins": [
  {"type": "ptp", "ipMasq": false, "mtu": 1500,
   "ipam": {"type": "static", "addresses": %s, "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0"}]}},
  {"type": "mtlsbridge-cni", "stateDir": %q, "waitTimeout": "10s"}]}`, sb.StaticAddresses(), stateDir)
		})
		b.nodes[i] = n
	}
	// Registered before anything starts: a setup that fails half-way
	// stops what it started (cleanups run before the namespaces go).
	t.Cleanup(func() {
		for _, n := range b.nodes {
			n.stop()
		}
		if t.Failed() {
			for _, n := range b.nodes {
				for _, f := range []string{"agent.log", "proxy.log"} {
					log, _ := os.ReadFile(filepath.Join(n.stateDir, f))
					t.Logf("%s %s (last 32 KiB):\n%s", n.name, f, log[max(0, len(log)-32<<10):])
				}
			}
		}
	})
	c.init(b)
	for _, n := range b.nodes {
		n.startAgent()
	}
	for _, n := range b.nodes {
		n.waitAgent()
		n.proxyPod = n.addPod("ztunnel-"+n.name[len("node-"):], "kube-system", false, true)
		n.tokenPath = filepath.Join(n.stateDir, "istio-token")
		must(t, os.WriteFile(n.tokenPath, []byte(c.token(n.proxyPod)), 0o600))
		n.startProxy()
	}
	for _, n := range b.nodes {
		n.waitProxyReady()
	}
	b.underlay = na.Capture(t, netnstest.UplinkName)
	if cfg.tunnel != "" {
		b.uplink, b.underlay = b.underlay, na.Capture(t, cfg.tunnel.Device())
	}
	return b
}

// start runs a process of the testbed inside a namespace, appending its
// output to log.
func (b *bed) start(netns, log string, env []string, args ...string) *proc {
	f, err := os.OpenFile(log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	must(b.t, err)
	defer f.Close()
	fmt.Fprintf(f, "=== started at %s\n", time.Now().Format(time.RFC3339Nano))
	cmd := exec.Command("nsenter", append([]string{"--net=/run/netns/" + netns, "--"}, args...)...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.Env = env
	must(b.t, cmd.Start())
	p := &proc{cmd: cmd, done: make(chan struct{})}
	go func() { cmd.Wait(); close(p.done) }()
	return p
}

func (p *proc) signal(sig syscall.Signal) {
	if p == nil {
		return
	}
	p.cmd.Process.Signal(sig)
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		p.cmd.Process.Kill()
		<-p.done
	}
}

func (n *bedNode) startAgent() {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.agent != nil {
		return
	}
	args := append([]string{filepath.Join(n.bed.bin, "mtlsbridge"), "agent",
		"--node-name=" + n.name, "--state-dir=" + n.stateDir, "--bpf-root=" + n.bpfRoot,
		"--devices=" + netnstest.UplinkName, "--grpc-listen=" + n.grpc, "--ca-dir=" + n.bed.caDir,
		"--bypass-check-interval=1s"}, n.bed.cluster.agentArgs(n)...)
	if n.inPod {
		args = append(args, "--redirect-mode=inpod", "--zds-socket="+n.zdsSocket, "--netns-dir="+n.netnsDir,
			// The testbed's pods are seconds old when a test makes the
			// agent forget them.
			"--netns-search-min-age=1s")
	}
	// The kubelet's probes need no ztunnel; the nodes route in the
	// kernel's stack, as Cilium's legacy host routing does. Given in l2
	// too, so that a node switched back removes the table.
	args = append(args, "--probe-snat")
	n.agent = n.bed.start(n.ns.Name, filepath.Join(n.stateDir, "agent.log"), os.Environ(), args...)
}

// killAgent stops the agent with SIGKILL: no stop hook runs.
func (n *bedNode) killAgent() {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.agent.signal(syscall.SIGKILL)
	n.agent = nil
}

func (n *bedNode) startProxy() {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.proxy != nil {
		return
	}
	root := filepath.Join(n.stateDir, "ca", identity.RootCertFile)
	env := []string{
		proxy.EnvXDSAddress + "=https://" + n.grpc,
		proxy.EnvCAAddress + "=https://" + n.grpc,
		proxy.EnvXDSRootCA + "=" + root,
		proxy.EnvCARootCA + "=" + root,
		proxy.EnvAuthToken + "=" + n.tokenPath,
		proxy.EnvPodName + "=" + n.proxyPod.name,
		proxy.EnvPodNamespace + "=" + n.proxyPod.namespace,
		proxy.EnvNodeName + "=" + n.name,
		proxy.EnvInstanceIP + "=" + n.proxyPod.ip4.String(),
		proxy.EnvClusterID + "=Kubernetes",
	}
	if n.inPod {
		env = append(env, proxy.EnvInPodUDS+"="+n.zdsSocket)
	}
	n.proxy = n.bed.start(n.proxyPod.ns.Name, filepath.Join(n.stateDir, "proxy.log"), env,
		filepath.Join(n.bed.bin, "mtlsbridge-proxy"))
}

// killProxy stops the proxy with SIGKILL: its capture stays in place.
func (n *bedNode) killProxy() {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.proxy.signal(syscall.SIGKILL)
	n.proxy = nil
}

// stopProxy stops the proxy with SIGTERM: it removes its capture.
func (n *bedNode) stopProxy() {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.proxy.signal(syscall.SIGTERM)
	n.proxy = nil
}

func (n *bedNode) stop() {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.proxy.signal(syscall.SIGTERM)
	n.agent.signal(syscall.SIGTERM)
	n.proxy, n.agent = nil, nil
}

// switchMode restarts the node's agent and proxy in the l2 or (inPod) the
// in-pod mode, as an operator's update does: both stopped (SIGTERM), then
// started with the other mode's flags and environment. Neither waits for
// the other (in the in-pod mode, the agent is ready only once ztunnel
// serves its enrolled pods).
func (n *bedNode) switchMode(inPod bool) {
	n.stop()
	n.mu.Lock()
	n.inPod = inPod
	n.mu.Unlock()
	n.startAgent()
	n.startProxy()
	n.waitAgent()
	n.waitProxyReady()
}

// waitAgent waits until the agent's tables are all initialized.
func (n *bedNode) waitAgent() {
	n.bed.t.Helper()
	client := http.Client{Timeout: time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", filepath.Join(n.stateDir, "api.sock"))
		},
	}}
	n.bed.eventually(fmt.Sprintf("%s's agent healthy", n.name), func() error {
		resp, err := client.Get("http://agent/healthz")
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			body, _ := io.ReadAll(io.LimitReader(resp.Body, 4<<10))
			return fmt.Errorf("%s: %s", resp.Status, body)
		}
		return nil
	})
}

// get fetches a URL from inside the node's namespace.
func (n *bedNode) get(url string) (int, []byte, error) { return getFrom(n.ns.NS, url) }

// getFrom fetches url over a connection made from inside ns (a proxy's
// admin port listens on its pod's loopback only).
func getFrom(ns *netnstest.NS, url string) (int, []byte, error) {
	client := ns.HTTPClient(2 * time.Second)
	resp, err := client.Get(url)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 4<<20))
	return resp.StatusCode, b, err
}

// waitProxyReady waits for the proxy's /healthz/ready (port 15021).
func (n *bedNode) waitProxyReady() {
	n.bed.t.Helper()
	url := "http://" + netip.AddrPortFrom(n.proxyPod.ip4, proxy.ReadinessPort).String() + proxy.ReadyPath
	n.bed.eventually(n.name+"'s proxy ready", func() error {
		code, body, err := n.get(url)
		if err == nil && code != http.StatusOK {
			err = fmt.Errorf("%d %s", code, body)
		}
		return err
	})
}

// sysmonAwake is the GODEBUG setting the proxy runs with
// (cmd/mtlsbridge-proxy/sysmon.go).
const sysmonAwake = "schedtrace=2147483647"

// expectSysmonAwake checks that the proxy runs with the Go runtime's
// monitor kept out of its deep sleep (cmd/mtlsbridge-proxy/sysmon.go),
// which it does by executing itself again: the environment of its
// process image says whether it did.
func (n *bedNode) expectSysmonAwake(t *testing.T) {
	t.Helper()
	environ, err := os.ReadFile(fmt.Sprintf("/proc/%d/environ", n.proxy.cmd.Process.Pid))
	must(t, err)
	for kv := range strings.SplitSeq(string(environ), "\x00") {
		if v, ok := strings.CutPrefix(kv, "GODEBUG="); ok && slices.Contains(strings.Split(v, ","), sysmonAwake) {
			return
		}
	}
	t.Errorf("%s's proxy runs without schedtrace in GODEBUG: %q", n.name, environ)
}

// configDump is the proxy's /config_dump, read on its admin port (from
// inside its pod: the port is on loopback).
func (n *bedNode) configDump() (proxy.ConfigDump, error) {
	var d proxy.ConfigDump
	code, body, err := getFrom(n.proxyPod.ns, n.adminURL(proxy.ConfigDumpPath))
	if err == nil && code != http.StatusOK {
		err = fmt.Errorf("%s: %d %s", proxy.ConfigDumpPath, code, body)
	}
	if err != nil {
		return d, err
	}
	return d, json.Unmarshal(body, &d)
}

// adminURL is path on the proxy's admin port, from inside its pod.
func (n *bedNode) adminURL(path string) string {
	return "http://" + netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), proxy.AdminPort).String() + path
}

// metric reads one sample of the proxy's /metrics (port 15020): the sum of
// the series of name whose labels include every label given.
func (n *bedNode) metric(name string, labels ...string) float64 {
	n.bed.t.Helper()
	code, body, err := n.get("http://" + netip.AddrPortFrom(n.proxyPod.ip4, proxy.MetricsPort).String() + "/metrics")
	if err != nil || code != http.StatusOK {
		n.bed.t.Fatalf("%s's proxy metrics: %d %v", n.name, code, err)
	}
	sum := 0.0
	for line := range strings.Lines(string(body)) {
		if !strings.HasPrefix(line, name) || strings.HasPrefix(line, "#") {
			continue
		}
		series, value, ok := strings.Cut(strings.TrimSpace(line), " ")
		if !ok || (series != name && !strings.HasPrefix(series, name+"{")) {
			continue
		}
		match := true
		for _, l := range labels {
			match = match && strings.Contains(series, l)
		}
		if v, err := strconv.ParseFloat(value, 64); err == nil && match {
			sum += v
		}
	}
	return sum
}

// addPod creates a pod on the node: in the API first (no address), then
// its sandbox through the CNI chain (which holds an enrolled pod until its
// redirect is in place), then its addresses in the API as the kubelet
// writes them; and starts its servers.
func (n *bedNode) addPod(name, namespace string, enrolled, isProxy bool) *bedPod {
	b := n.bed
	b.t.Helper()
	n.mu.Lock()
	last := 2
	if !isProxy {
		last = n.nextAddr
		n.nextAddr++
	}
	n.mu.Unlock()
	p := &bedPod{name: name, namespace: namespace, serviceAccount: name, node: n, enrolled: enrolled, isProxy: isProxy,
		ns:  netnstest.NewNS(b.t, "mtlsb-"+name),
		ip4: netip.AddrFrom4([4]byte{10, byte(n.index), 0, byte(last)}),
		ip6: netip.MustParseAddr(fmt.Sprintf("fd00:%d::%x", n.index, last))}
	if isProxy {
		p.serviceAccount = "ztunnel"
	}
	p.ns.Sysctl(b.t, "ipv6/conf/default/accept_dad", "0")
	p.ns.Pin(b.t, filepath.Join(n.netnsDir, p.ns.Name))
	p.sb = cnitest.NewSandbox(p.ns, namespace, name)
	p.sb.Addrs = []netip.Prefix{netip.PrefixFrom(p.ip4, 24), netip.PrefixFrom(p.ip6, 64)}
	p.sb.Gateways = []netip.Addr{netip.AddrFrom4([4]byte{10, byte(n.index), 0, 1}), netip.MustParseAddr(fmt.Sprintf("fd00:%d::1", n.index))}
	b.cluster.putPod(p) // sets p.sb.UID to the pod's
	ctx, cancel := context.WithTimeout(context.Background(), bedTimeout)
	defer cancel()
	for {
		_, err := n.runtime.Add(ctx, p.sb)
		if err == nil {
			break
		}
		n.runtime.Del(context.Background(), p.sb)
		if ctx.Err() != nil {
			b.t.Fatalf("pod %s did not start: %v", name, err)
		}
		time.Sleep(200 * time.Millisecond)
		p.sb.ContainerID = cnitest.NewSandbox(p.ns, namespace, name).ContainerID
	}
	p.running = true
	// Folder mode: the redirect is in place (ADD returned), so the test
	// publishes it as the agent does in Kubernetes mode.
	p.published = enrolled
	b.cluster.putPod(p)
	if !isProxy {
		serveDigest(b.t, p)
		serveEcho(b.t, p)
	}
	return p
}

// setEnrolled enrolls (label cilium.io/redir-type=workload) or unenrolls a
// running pod.
func (b *bed) setEnrolled(p *bedPod, enrolled bool) {
	p.enrolled = enrolled
	p.published = enrolled
	b.cluster.putPod(p)
}

// eventually retries fn until it succeeds, at most bedTimeout.
func (b *bed) eventually(what string, fn func() error) {
	b.t.Helper()
	deadline := time.Now().Add(bedTimeout)
	for {
		err := fn()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			b.t.Fatalf("%s: not within %s: %v", what, bedTimeout, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// knows waits until the proxy of node n holds what it needs for from's
// connections to to: from's certificate (when enrolled) and to's Workload
// with HBONE as wanted (absent when to is not enrolled).
func (b *bed) knows(n *bedNode, from, to *bedPod, hbone bool) {
	b.t.Helper()
	b.eventually(fmt.Sprintf("%s's proxy ready for %s -> %s", n.name, from, to), func() error {
		d, err := n.configDump()
		if err != nil {
			return err
		}
		if from != nil && from.enrolled {
			held := false
			for _, c := range d.Certificates {
				held = held || c.Identity == from.identity()
			}
			if !held {
				return fmt.Errorf("no certificate of %s", from.identity())
			}
			// The source is found by its address: the one it has now.
			if w := dumped(d, from); w == nil || !hasAddrs(w, from) {
				return fmt.Errorf("%s is not a workload at %s, %s yet", from, from.ip4, from.ip6)
			}
		}
		if to == nil {
			return nil
		}
		w := dumped(d, to)
		switch {
		case w == nil && to.enrolled:
			return fmt.Errorf("%s is not a workload yet", to)
		case w == nil:
			return nil
		case !to.enrolled:
			return fmt.Errorf("%s is still a workload", to)
		case w.HBONE != hbone:
			return fmt.Errorf("%s has HBONE %v", to, w.HBONE)
		case !hasAddrs(w, to):
			// A pod given new addresses (a new sandbox): the peer checks
			// the source address against the identity it proved.
			return fmt.Errorf("%s is a workload at %v, not yet at %s, %s", to, w.Addresses, to.ip4, to.ip6)
		}
		return nil
	})
}

// dumped is p's workload in a proxy's config dump, or nil.
func dumped(d proxy.ConfigDump, p *bedPod) *proxy.Workload {
	for _, w := range d.Workloads {
		if w.Name == p.name && w.Namespace == p.namespace {
			return w
		}
	}
	return nil
}

// hasAddrs: the workload holds the pod's current addresses.
func hasAddrs(w *proxy.Workload, p *bedPod) bool {
	return (!p.ip4.IsValid() || w.HasAddress(p.ip4)) && (!p.ip6.IsValid() || w.HasAddress(p.ip6))
}

// serveDigest answers, once a client has sent everything (half-close), one
// line: "NAME REMOTE SHA256 LENGTH".
func serveDigest(t testing.TB, p *bedPod) {
	serve(t, p, digestPort, func(c net.Conn) {
		c.SetDeadline(time.Now().Add(2 * requestTimeout))
		h := sha256.New()
		n, _ := io.Copy(h, io.LimitReader(c, maxPayload))
		fmt.Fprintf(c, "%s %s %x %d\n", p.name, c.RemoteAddr(), h.Sum(nil), n)
	})
}

// serveEcho echoes lines until the client closes (at most a minute).
func serveEcho(t testing.TB, p *bedPod) {
	serve(t, p, echoPort, func(c net.Conn) {
		c.SetDeadline(time.Now().Add(time.Minute))
		io.Copy(c, io.LimitReader(c, maxPayload))
	})
}

func serve(t testing.TB, p *bedPod, port uint16, handle func(net.Conn)) {
	for _, ip := range []netip.Addr{p.ip4, p.ip6} {
		var l net.Listener
		must(t, p.ns.Do(func() (err error) {
			l, err = net.Listen("tcp", netip.AddrPortFrom(ip, port).String())
			return err
		}))
		t.Cleanup(func() { l.Close() })
		go acceptEach(l, handle)
	}
}

// acceptEach serves each connection l accepts in its own goroutine, until
// l is closed.
func acceptEach(l net.Listener, handle func(net.Conn)) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		go func() { defer c.Close(); handle(c) }()
	}
}

// reply is a digest server's answer.
type reply struct {
	server string
	remote netip.AddrPort
	digest string
	length int
}

// requestBody is a request body that carries marker many times, so that a
// capture finds it in any segment of it that crosses the wire in clear.
func requestBody(marker []byte, size int) []byte {
	var b []byte
	for len(b) < size {
		b = append(b, marker...)
		b = append(b, ' ')
	}
	return b[:size]
}

// send connects from the pod to dst, sends body, half-closes, and reads
// the digest server's reply; it checks that the body arrived intact.
func send(from *bedPod, dst netip.AddrPort, body []byte) (reply, error) {
	return sendFrom(from.ns, dst, body)
}

// sendFrom is send from any namespace (a node's).
func sendFrom(ns *netnstest.NS, dst netip.AddrPort, body []byte) (reply, error) {
	var c net.Conn
	err := ns.Do(func() (err error) {
		c, err = net.DialTimeout("tcp", dst.String(), requestTimeout)
		return err
	})
	if err != nil {
		return reply{}, err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(requestTimeout))
	if _, err := c.Write(body); err != nil {
		return reply{}, fmt.Errorf("write: %w", err)
	}
	c.(*net.TCPConn).CloseWrite()
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return reply{}, fmt.Errorf("read reply: %w", err)
	}
	f := strings.Fields(line)
	if len(f) != 4 {
		return reply{}, fmt.Errorf("bad reply %q", line)
	}
	remote, err := netip.ParseAddrPort(f[1])
	if err != nil {
		return reply{}, err
	}
	n, _ := strconv.Atoi(f[3])
	r := reply{server: f[0], remote: netip.AddrPortFrom(remote.Addr().Unmap(), remote.Port()), digest: f[2], length: n}
	sum := sha256.Sum256(body)
	if r.digest != hex.EncodeToString(sum[:]) || r.length != len(body) {
		return r, fmt.Errorf("payload damaged: %d bytes arrived with digest %s", r.length, r.digest)
	}
	return r, nil
}

// cluster is the API the agents watch: what a kubelet and an operator
// write, and the proxies' credentials.
type cluster interface {
	// init writes the namespaces and nodes.
	init(b *bed)
	// agentArgs are the flags that point an agent at the cluster.
	agentArgs(n *bedNode) []string
	// putPod writes a pod as it is now (creating it the first time and
	// setting p.sb.UID to its UID).
	putPod(p *bedPod)
	// deletePod deletes a pod at once, as kubectl delete --force does; its
	// sandbox runs on.
	deletePod(p *bedPod)
	// token returns a bearer token for the proxy pod.
	token(p *bedPod) string
}

// folderCluster is a manifest folder both agents read. No agent publishes
// readiness in folder mode: the test writes mtlsbridge.io/redirect: ready
// on an enrolled pod once its CNI ADD returned (its node redirects it).
type folderCluster struct {
	t   testing.TB
	dir string
	mu  sync.Mutex
}

func newFolderCluster(t testing.TB) *folderCluster { return &folderCluster{t: t, dir: t.TempDir()} }

func (c *folderCluster) init(b *bed) {
	var docs []string
	docs = append(docs, "apiVersion: v1\nkind: Namespace\nmetadata: {name: app}\n",
		"apiVersion: v1\nkind: Namespace\nmetadata: {name: kube-system}\n")
	for _, n := range b.nodes {
		docs = append(docs, fmt.Sprintf("apiVersion: v1\nkind: Node\nmetadata: {name: %s}\nstatus: {addresses: [{type: InternalIP, address: %s}]}\n", n.name, n.ns.Addr4))
	}
	c.write("cluster.yaml", strings.Join(docs, "---\n"))
}

func (c *folderCluster) agentArgs(n *bedNode) []string {
	return []string{"--source=dir:" + c.dir, "--token-file=" + filepath.Join(n.stateDir, "tokens")}
}

func (c *folderCluster) putPod(p *bedPod) {
	p.created = true // the sandbox's UID is the pod's
	labels, annotations := "", ""
	switch {
	case p.isProxy:
		labels = tables.RedirTypeLabel + ": " + tables.RedirTypeProxy
	case p.enrolled:
		labels = tables.RedirTypeLabel + ": " + tables.RedirTypeWorkload
	}
	if p.published {
		annotations = "mtlsbridge.io/redirect: ready"
	}
	status := "{phase: Pending}"
	if p.running {
		status = fmt.Sprintf("{phase: Running, podIPs: [{ip: %s}, {ip: %q}]}", p.ip4, p.ip6)
	}
	c.write(fmt.Sprintf("pod-%s-%s.yaml", p.namespace, p.name), fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata: {name: %s, namespace: %s, uid: %s, labels: {%s}, annotations: {%s}}
spec: {nodeName: %s, serviceAccountName: %s}
status: %s
`, p.name, p.namespace, p.sb.UID, labels, annotations, p.node.name, p.serviceAccount, status))
}

func (c *folderCluster) deletePod(p *bedPod) {
	c.mu.Lock()
	defer c.mu.Unlock()
	must(c.t, os.Remove(filepath.Join(c.dir, fmt.Sprintf("pod-%s-%s.yaml", p.namespace, p.name))))
}

func (c *folderCluster) token(p *bedPod) string {
	token := "tok-" + p.node.name
	c.mu.Lock()
	defer c.mu.Unlock()
	f, err := os.OpenFile(filepath.Join(p.node.stateDir, "tokens"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err == nil {
		fmt.Fprintf(f, "%s %s/%s\n", token, p.namespace, p.name)
		err = f.Close()
	}
	must(c.t, err)
	return token
}

// write replaces a manifest atomically (the agents watch the folder).
func (c *folderCluster) write(name, content string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	must(c.t, manifesttest.Write(c.dir, name, []byte(content)))
}
