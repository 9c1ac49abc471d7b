// SPDX-License-Identifier: Apache-2.0

package cnitest_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/mtlsbridge/mtlsbridge/internal/cnitest"
	"github.com/mtlsbridge/mtlsbridge/internal/netnstest"
)

var (
	podAddrs = []netip.Prefix{netip.MustParsePrefix("10.1.0.20/24"), netip.MustParsePrefix("fd00:1::20/64")}
	gateways = []netip.Addr{netip.MustParseAddr("10.1.0.1"), netip.MustParseAddr("fd00:1::1")}
)

// ptpConflist is a chain of ptp with static IPAM alone.
func ptpConflist(sb cnitest.Sandbox) []byte {
	return fmt.Appendf(nil, `{"cniVersion": "1.0.0", "name": "node", "plugins": [
  {"type": "ptp", "ipMasq": false, "mtu": 1500,
   "ipam": {"type": "static", "addresses": %s, "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0"}]}}]}`,
		sb.StaticAddresses())
}

func TestStaticAddresses(t *testing.T) {
	sb := cnitest.Sandbox{Addrs: append(podAddrs, netip.MustParsePrefix("10.2.0.5/24")), Gateways: gateways[1:]}
	want := `[{"address":"10.1.0.20/24"},{"address":"fd00:1::20/64","gateway":"fd00:1::1"},{"address":"10.2.0.5/24"}]`
	if got := sb.StaticAddresses(); got != want {
		t.Fatalf("got  %s\nwant %s", got, want)
	}
	if got := (cnitest.Sandbox{}).StaticAddresses(); got != "[]" {
		t.Fatalf("no addresses: %s", got)
	}
}

// TestPtp runs ADD, CHECK and DEL of ptp with static IPAM for a pod, with a
// namespace as the node, and checks that everything happened in the node
// and the pod and nothing in the root namespace.
func TestPtp(t *testing.T) {
	netnstest.RequirePrivileged(t)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()

	node, pod := netnstest.NewNS(t, "mtlsb-cninode"), netnstest.NewNS(t, "mtlsb-cnipod")
	// No duplicate address detection: addresses are usable at once.
	node.Sysctl(t, "ipv6/conf/default/accept_dad", "0")
	pod.Sysctl(t, "ipv6/conf/default/accept_dad", "0")
	rootBefore := rootState(t)

	rt := cnitest.NewRuntime(t, node, cnitest.Plugins(t), ptpConflist)
	sb := cnitest.NewSandbox(pod, "app", "web")
	sb.Addrs, sb.Gateways = podAddrs, gateways
	res, err := rt.Add(ctx, sb)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := json.Marshal(res)
	t.Logf("ADD result: %s", b)
	if len(res.Interfaces) != 2 || res.Interfaces[1].Name != cnitest.IfName || res.Interfaces[1].Sandbox != sb.Netns {
		t.Fatalf("interfaces: %v", res.Interfaces)
	}
	hostIf := res.Interfaces[0].Name

	// The pod: eth0 with its addresses.
	ph := pod.Netlink(t)
	eth0, err := ph.LinkByName(cnitest.IfName)
	if err != nil {
		t.Fatal(err)
	}
	if got := addrs(t, ph, eth0, unix.AF_UNSPEC); !containsAll(got, podAddrs) {
		t.Fatalf("pod eth0 addresses %v, want %v", got, podAddrs)
	}

	// The node: the veth, holding the gateways, with a host route to each
	// pod address through it.
	nh := node.Netlink(t)
	veth, err := nh.LinkByName(hostIf)
	if err != nil {
		t.Fatalf("host veth %s not in the node: %v", hostIf, err)
	}
	t.Logf("node %s addresses: %v", hostIf, addrs(t, nh, veth, unix.AF_UNSPEC))
	for _, p := range podAddrs {
		host := netip.PrefixFrom(p.Addr(), p.Addr().BitLen())
		routes, err := nh.RouteGet(p.Addr().AsSlice())
		if err != nil || len(routes) != 1 || routes[0].LinkIndex != veth.Attrs().Index {
			t.Fatalf("node route to %s: %v, want through %s", p.Addr(), routes, hostIf)
		}
		exact, err := nh.RouteListFiltered(family(p.Addr()), &netlink.Route{
			Dst: &net.IPNet{IP: host.Addr().AsSlice(), Mask: net.CIDRMask(host.Bits(), host.Bits())}, LinkIndex: veth.Attrs().Index,
		}, netlink.RT_FILTER_DST|netlink.RT_FILTER_OIF)
		if err != nil || len(exact) != 1 {
			t.Fatalf("node has no %s route through %s: %v", host, hostIf, exact)
		}
	}

	// Traffic: the pod reaches a listener of the node on its gateways.
	node.Serve(t, "node", 8080, false, gateways...)
	for i, gw := range gateways {
		ans, err := pod.Ask(netip.AddrPortFrom(gw, 8080))
		if err != nil {
			t.Fatalf("pod -> %s: %v", gw, err)
		}
		if ans.Server != "node" || ans.Remote.Addr() != podAddrs[i].Addr() {
			t.Fatalf("pod -> %s: answered by %s", gw, ans)
		}
	}

	if err := rt.Check(ctx, sb); err != nil {
		t.Fatalf("CHECK: %v", err)
	}

	// The plugins ran in the node: the root namespace has no new link, and
	// its forwarding settings, which ptp turns on, are as they were.
	if after := rootState(t); !slices.Equal(after, rootBefore) {
		t.Fatalf("root namespace changed:\nbefore %v\nafter  %v", rootBefore, after)
	}
	if err := node.Do(func() error {
		return expectFile("/proc/sys/net/ipv4/ip_forward", "1")
	}); err != nil {
		t.Fatalf("ptp did not turn forwarding on in the node: %v", err)
	}

	if err := rt.Del(ctx, sb); err != nil {
		t.Fatalf("DEL: %v", err)
	}
	if _, err := nh.LinkByName(hostIf); err == nil {
		t.Fatalf("host veth %s still there after DEL", hostIf)
	}
	if _, err := ph.LinkByName(cnitest.IfName); err == nil {
		t.Fatal("pod eth0 still there after DEL")
	}
	// A runtime repeats DEL until it succeeds; it must succeed when there
	// is nothing left.
	if err := rt.Del(ctx, sb); err != nil {
		t.Fatalf("second DEL: %v", err)
	}
	if after := rootState(t); !slices.Equal(after, rootBefore) {
		t.Fatalf("root namespace changed:\nbefore %v\nafter  %v", rootBefore, after)
	}
}

// TestMissingPlugin: the error of libcni comes back.
func TestMissingPlugin(t *testing.T) {
	netnstest.RequirePrivileged(t)
	node, pod := netnstest.NewNS(t, "mtlsb-cninode"), netnstest.NewNS(t, "mtlsb-cnipod")
	rt := cnitest.NewRuntime(t, node, t.TempDir(), ptpConflist)
	_, err := rt.Add(t.Context(), cnitest.NewSandbox(pod, "app", "web"))
	if err == nil || !strings.Contains(err.Error(), `failed to find plugin "ptp"`) {
		t.Fatalf("ADD with no plugins: %v", err)
	}
}

// TestBinaries: the folder holds the four programs, and ours run.
func TestBinaries(t *testing.T) {
	dir := cnitest.Binaries(t)
	for _, name := range []string{"ptp", "static", "mtlsbridge", "mtlsbridge-cni"} {
		st, err := os.Stat(filepath.Join(dir, name))
		if err != nil || st.Mode()&0o111 == 0 {
			t.Fatalf("%s: %v %v", name, st, err)
		}
	}
	if len(dir) > 40 {
		t.Errorf("folder %s: not short", dir)
	}
	if out, err := exec.Command(filepath.Join(dir, "mtlsbridge"), "version").CombinedOutput(); err != nil {
		t.Fatalf("mtlsbridge version: %v: %s", err, out)
	}
	cmd := exec.Command(filepath.Join(dir, "mtlsbridge-cni"))
	cmd.Env = []string{"CNI_COMMAND=VERSION"}
	cmd.Stdin = strings.NewReader(`{"cniVersion": "1.0.0"}`)
	if out, err := cmd.Output(); err != nil || !strings.Contains(string(out), "supportedVersions") {
		t.Fatalf("mtlsbridge-cni VERSION: %v: %s", err, out)
	}
}

// rootState lists the root namespace's links (index and name) and its
// forwarding settings.
func rootState(t *testing.T) []string {
	t.Helper()
	root, err := netns.GetFromPid(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	h, err := netlink.NewHandleAt(root)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	links, err := h.LinkList()
	if err != nil {
		t.Fatal(err)
	}
	var state []string
	for _, l := range links {
		state = append(state, fmt.Sprintf("%d:%s", l.Attrs().Index, l.Attrs().Name))
	}
	// The test's own thread is in the root namespace, so /proc/sys/net is
	// the root's.
	for _, f := range []string{"/proc/sys/net/ipv4/ip_forward", "/proc/sys/net/ipv6/conf/all/forwarding"} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		state = append(state, f+"="+strings.TrimSpace(string(b)))
	}
	return state
}

func addrs(t *testing.T, h *netlink.Handle, l netlink.Link, family int) []netip.Prefix {
	t.Helper()
	list, err := h.AddrList(l, family)
	if err != nil {
		t.Fatal(err)
	}
	var out []netip.Prefix
	for _, a := range list {
		ip, _ := netip.AddrFromSlice(a.IP)
		ones, _ := a.Mask.Size()
		out = append(out, netip.PrefixFrom(ip.Unmap(), ones))
	}
	return out
}

func containsAll(have, want []netip.Prefix) bool {
	for _, w := range want {
		if !slices.Contains(have, w) {
			return false
		}
	}
	return true
}

func family(a netip.Addr) int {
	if a.Is4() {
		return unix.AF_INET
	}
	return unix.AF_INET6
}

func expectFile(name, want string) error {
	b, err := os.ReadFile(name)
	if err != nil {
		return err
	}
	if got := strings.TrimSpace(string(b)); got != want {
		return fmt.Errorf("%s is %s, want %s", name, got, want)
	}
	return nil
}

// TestPluginsRunInNode: a plugin process lives in the node's network
// namespace, not the root's: it reports the namespace it runs in.
func TestPluginsRunInNode(t *testing.T) {
	netnstest.RequirePrivileged(t)
	node, pod := netnstest.NewNS(t, "mtlsb-cninode"), netnstest.NewNS(t, "mtlsb-cnipod")
	dir := t.TempDir()
	report := filepath.Join(dir, "netns")
	script := "#!/bin/sh\nreadlink /proc/self/ns/net > " + report + "\necho '{\"cniVersion\": \"1.0.0\"}'\n"
	if err := os.WriteFile(filepath.Join(dir, "whereami"), []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	rt := cnitest.NewRuntime(t, node, dir, func(cnitest.Sandbox) []byte {
		return []byte(`{"cniVersion": "1.0.0", "name": "node", "plugins": [{"type": "whereami"}]}`)
	})
	if _, err := rt.Add(t.Context(), cnitest.NewSandbox(pod, "app", "web")); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(report)
	if err != nil {
		t.Fatal(err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(node.Handle), &st); err != nil {
		t.Fatal(err)
	}
	if ran, want := strings.TrimSpace(string(got)), fmt.Sprintf("net:[%d]", st.Ino); ran != want {
		t.Fatalf("plugin ran in %s, the node is %s", ran, want)
	}
}
