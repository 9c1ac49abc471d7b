// SPDX-License-Identifier: Apache-2.0

// Package cnitest lets a privileged test play the container runtime of a
// node: it runs a real CNI chain through libcni, as kubelet's runtime does,
// with a network namespace of the test (netnstest) standing for the node.
// The chain is typically the reference plugins ptp with static IPAM (from
// github.com/containernetworking/plugins, built by hack/cni-plugins.sh), then
// mtlsbridge-cni chained after them, as it is after Cilium.
//
// Every plugin runs with the node's namespace as its own ("host")
// namespace: libcni is called from a thread switched into it, and the
// plugin processes forked from that thread inherit it. Nothing is created
// in the root namespace.
//
// static IPAM takes a pod's addresses from the configuration, so a Runtime
// builds the conflist for each call from a template given the Sandbox; its
// StaticAddresses fills in the addresses:
//
//	rt := cnitest.NewRuntime(t, node, cnitest.Binaries(t), func(sb cnitest.Sandbox) []byte {
//		return fmt.Appendf(nil, `{"cniVersion": "1.0.0", "name": "node", "plugins": [
//		  {"type": "ptp", "ipMasq": false, "mtu": 1500,
//		   "ipam": {"type": "static", "addresses": %s,
//		            "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0"}]}},
//		  {"type": "mtlsbridge-cni", "stateDir": %q}]}`, sb.StaticAddresses(), stateDir)
//	})
//	sb := cnitest.NewSandbox(pod, "app", "web")
//	sb.Addrs = []netip.Prefix{netip.MustParsePrefix("10.1.0.20/24"), netip.MustParsePrefix("fd00:1::20/64")}
//	sb.Gateways = []netip.Addr{netip.MustParseAddr("10.1.0.1"), netip.MustParseAddr("fd00:1::1")}
//	res, err := rt.Add(ctx, sb)
//
// ptp then gives the pod eth0 with those addresses and routes through the
// gateways, and the node a veth (named in res.Interfaces[0]) that holds the
// gateways as /32 and /128 addresses, with a /32 (/128) route to each pod
// address through it. Routes without "gw" go through the gateway of their
// family. ptp turns on forwarding in the node.
package cnitest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"net/netip"
	"path/filepath"
	"testing"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/invoke"
	types100 "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/mtlsbridge/mtlsbridge/internal/netnstest"
)

// IfName is the interface every sandbox gets, as kubelet asks for.
const IfName = "eth0"

// Sandbox is one pod sandbox as the runtime knows it.
type Sandbox struct {
	ContainerID string
	// Netns is the path of the pod's network namespace, /run/netns/NAME.
	Netns                string
	Namespace, Name, UID string
	// Addrs and Gateways are the pod's addresses, for the conflist template
	// (StaticAddresses); the runtime itself does not read them.
	Addrs    []netip.Prefix
	Gateways []netip.Addr
}

// NewSandbox describes a pod in the namespace pod, with a fresh container id
// and UID and no addresses yet.
func NewSandbox(pod *netnstest.NS, namespace, name string) Sandbox {
	return Sandbox{
		ContainerID: randomHex(32), // as long as containerd's ids
		Netns:       filepath.Join("/run/netns", pod.Name),
		Namespace:   namespace,
		Name:        name,
		UID:         randomHex(16),
	}
}

// StaticAddresses is the "addresses" list of a static IPAM configuration
// (JSON): each of Addrs, with the first of Gateways of its family.
func (sb Sandbox) StaticAddresses() string {
	type address struct {
		Address netip.Prefix `json:"address"`
		Gateway *netip.Addr  `json:"gateway,omitempty"`
	}
	list := []address{}
	for _, p := range sb.Addrs {
		a := address{Address: p}
		for _, gw := range sb.Gateways {
			if gw.Is4() == p.Addr().Is4() {
				a.Gateway = &gw
				break
			}
		}
		list = append(list, a)
	}
	b, _ := json.Marshal(list) // prefixes and addresses always marshal
	return string(b)
}

// Runtime runs CNI chains for the sandboxes of one node.
type Runtime struct {
	node     *netnstest.NS
	cni      *libcni.CNIConfig
	conflist func(Sandbox) []byte
}

// NewRuntime returns a runtime for the node that finds plugins in binDir
// and builds the conflist of each call with conflist. libcni caches results
// (the prevResult of CHECK and DEL) in a folder of the test, never in
// /var/lib/cni. Plugins' stderr goes to the test log.
func NewRuntime(t testing.TB, node *netnstest.NS, binDir string, conflist func(Sandbox) []byte) *Runtime {
	exec := &invoke.DefaultExec{RawExec: &invoke.RawExec{Stderr: logWriter{t}}, PluginDecoder: version.PluginDecoder{}}
	return &Runtime{
		node:     node,
		cni:      libcni.NewCNIConfigWithCacheDir([]string{binDir}, t.TempDir(), exec),
		conflist: conflist,
	}
}

// Add runs ADD through the chain for the sandbox and returns the chain's
// result.
func (r *Runtime) Add(ctx context.Context, sb Sandbox) (*types100.Result, error) {
	var res *types100.Result
	err := r.run(sb, func(list *libcni.NetworkConfigList, rt *libcni.RuntimeConf) error {
		out, err := r.cni.AddNetworkList(ctx, list, rt)
		if err != nil {
			return err
		}
		res, err = types100.NewResultFromResult(out)
		return err
	})
	return res, err
}

// Check runs CHECK through the chain, against the result of the last Add.
func (r *Runtime) Check(ctx context.Context, sb Sandbox) error {
	return r.run(sb, func(list *libcni.NetworkConfigList, rt *libcni.RuntimeConf) error {
		return r.cni.CheckNetworkList(ctx, list, rt)
	})
}

// Del runs DEL through the chain, in reverse order.
func (r *Runtime) Del(ctx context.Context, sb Sandbox) error {
	return r.run(sb, func(list *libcni.NetworkConfigList, rt *libcni.RuntimeConf) error {
		return r.cni.DelNetworkList(ctx, list, rt)
	})
}

// run calls fn with the sandbox's conflist and runtime arguments, on a
// thread in the node's namespace: the plugins it forks inherit it.
func (r *Runtime) run(sb Sandbox, fn func(*libcni.NetworkConfigList, *libcni.RuntimeConf) error) error {
	list, err := libcni.ConfListFromBytes(r.conflist(sb))
	if err != nil {
		return err
	}
	rt := &libcni.RuntimeConf{
		ContainerID: sb.ContainerID,
		NetNS:       sb.Netns,
		IfName:      IfName,
		// What kubelet passes (CNI_ARGS).
		Args: [][2]string{
			{"IgnoreUnknown", "1"},
			{"K8S_POD_NAMESPACE", sb.Namespace},
			{"K8S_POD_NAME", sb.Name},
			{"K8S_POD_INFRA_CONTAINER_ID", sb.ContainerID},
			{"K8S_POD_UID", sb.UID},
		},
	}
	// fn's error is kept apart from Do's: a failing Do discards its thread,
	// which a failed CNI call gives no reason to.
	var ferr error
	if err := r.node.Do(func() error {
		ferr = fn(list, rt)
		return nil
	}); err != nil {
		return err
	}
	return ferr
}

// logWriter passes plugins' stderr to the test log.
type logWriter struct{ t testing.TB }

func (w logWriter) Write(p []byte) (int, error) {
	w.t.Logf("plugin stderr: %s", p)
	return len(p), nil
}

func randomHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}
