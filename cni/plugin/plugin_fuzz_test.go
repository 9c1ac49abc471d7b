// SPDX-License-Identifier: Apache-2.0

package plugin

import (
	"errors"
	"io"
	"testing"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
)

const fuzzConf = `{"cniVersion": "1.0.0", "name": "cilium", "type": "mtlsbridge-cni",
  "stateDir": "/nonexistent", "excludedNamespaces": ["kube-system"], "waitTimeout": "1s", "failPolicy": "closed",
  "prevResult": {"cniVersion": "1.0.0", "interfaces": [{"name": "eth0", "sandbox": "/var/run/netns/x"}],
    "ips": [{"address": "10.0.1.20/32", "interface": 0}, {"address": "fd00:1::20/128", "interface": 0}]}}`

// FuzzPlugin feeds arbitrary network configurations (stdin) and CNI
// environment (CNI_ARGS, CNI_CONTAINERID, CNI_NETNS, CNI_IFNAME) to the
// plugin: whoever writes the conflist or runs the plugin controls them.
// Parsing must never panic and must refuse with a CNI error (a code and a
// message); what it accepts must name a pod, carry a valid prevResult and
// a fail policy, and be answered (CHECK, the agent not reachable: fail
// closed or open as configured) with a CNI error or nothing. Seeds:
// testdata/fuzz/FuzzPlugin and below. Long runs: make fuzz.
func FuzzPlugin(f *testing.F) {
	args := "IgnoreUnknown=1;K8S_POD_NAMESPACE=app;K8S_POD_NAME=web;K8S_POD_INFRA_CONTAINER_ID=abc;K8S_POD_UID=u-1"
	f.Add([]byte(fuzzConf), args, "abc123", "/var/run/netns/x", "eth0")
	f.Add([]byte(`{"cniVersion": "1.0.0", "name": "x", "type": "mtlsbridge-cni", "prevResult": null}`), args, "abc", "", "")
	f.Add([]byte(`{"cniVersion": "0.4.0", "prevResult": {"cniVersion": "0.4.0", "ips": [{"version": "4", "address": "10.0.0.1/32"}]}, "failPolicy": "open"}`), "K8S_POD_NAMESPACE=kube-system;K8S_POD_NAME=dns", "x", "", "eth0")
	f.Add([]byte(`{"waitTimeout": "-1s", "prevResult": {}}`), "K8S_POD_NAME", "", "", "")
	f.Fuzz(func(t *testing.T, stdin []byte, cniArgs, containerID, netns, ifName string) {
		c, err := parse(&skel.CmdArgs{ContainerID: containerID, Netns: netns, IfName: ifName, Args: cniArgs, StdinData: stdin})
		if err != nil {
			checkCNIError(t, err)
			return
		}
		if c.namespace == "" || c.name == "" || (c.conf.FailPolicy != FailClosed && c.conf.FailPolicy != FailOpen) || c.wait < 0 {
			t.Fatalf("accepted %+v", c)
		}
		for _, ip := range c.req.IPs {
			if !ip.IsValid() || ip.Is4In6() {
				t.Fatalf("address %v in the request", ip)
			}
		}
		if err := c.printPrevResult(io.Discard); err != nil {
			t.Fatalf("accepted a prevResult it cannot print: %v", err)
		}
		// Never a socket the input names: a folder without one.
		c.conf.StateDir = t.TempDir()
		err = c.admit(io.Discard, false)
		switch {
		case err != nil:
			checkCNIError(t, err)
		case c.conf.FailPolicy == FailClosed && !excluded(c):
			t.Fatal("fail closed, without an agent, and admitted")
		}
	})
}

func excluded(c *call) bool {
	for _, ns := range c.conf.ExcludedNamespaces {
		if ns == c.namespace {
			return true
		}
	}
	return false
}

func checkCNIError(t *testing.T, err error) {
	t.Helper()
	var cniErr *types.Error
	if !errors.As(err, &cniErr) || cniErr.Code == 0 || cniErr.Msg == "" {
		t.Fatalf("not a CNI error with a code and a message: %#v", err)
	}
}
