// SPDX-License-Identifier: Apache-2.0

package grpcserver

import (
	"errors"
	"strings"
	"testing"

	"github.com/mtlsbridge/mtlsbridge/tables"
	"github.com/mtlsbridge/mtlsbridge/tables/ingest"
)

// The signer starts only where it can tell node agents apart: Kubernetes
// mode (TokenReview names service account and node), no node of its own,
// service accounts spelt NAMESPACE/NAME.
func TestSignerCallersConfig(t *testing.T) {
	for name, tc := range map[string]struct {
		accounts []string
		mode     ingest.Mode
		node     string
		want     string
	}{
		"the defaults":       {defaultNodeAgentConfig.NodeAgentServiceAccounts, ingest.Kubernetes, "", ""},
		"folder mode":        {defaultNodeAgentConfig.NodeAgentServiceAccounts, ingest.Folder, "", "--source=k8s"},
		"a node of its own":  {defaultNodeAgentConfig.NodeAgentServiceAccounts, ingest.Kubernetes, "node-a", "--node-name"},
		"no service account": {nil, ingest.Kubernetes, "", "at least one"},
		"not NAMESPACE/NAME": {[]string{"cilium"}, ingest.Kubernetes, "", "NAMESPACE/NAME"},
		"an empty namespace": {[]string{"/cilium"}, ingest.Kubernetes, "", "NAMESPACE/NAME"},
	} {
		_, err := newNodeAgentCallers(NodeAgentConfig{tc.accounts}, tc.mode, tables.LocalNode{NodeName: tc.node})
		if (tc.want == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("%s: %v, want %q", name, err, tc.want)
		}
	}
}

// A caller of the signer is a node agent only with a token that names its
// service account, one of the node agents', and its node.
func TestAllowedNodeAgent(t *testing.T) {
	a := &Authenticator{callers: Callers{NodeAgents: []string{"kube-system/cilium"}}}
	for name, tc := range map[string]struct {
		caller Caller
		reason string
	}{
		"a node agent":                {Caller{Namespace: "kube-system", Pod: "cilium-a", ServiceAccount: "cilium", Node: "node-a"}, ""},
		"no node":                     {Caller{Namespace: "kube-system", Pod: "cilium-a", ServiceAccount: "cilium"}, "no-node"},
		"another service account":     {Caller{Namespace: "kube-system", Pod: "ztunnel-a", ServiceAccount: "ztunnel", Node: "node-a"}, "not-node-agent"},
		"the same name elsewhere":     {Caller{Namespace: "app", Pod: "cilium-a", ServiceAccount: "cilium", Node: "node-a"}, "not-node-agent"},
		"no service account (a file)": {Caller{Namespace: "kube-system", Pod: "cilium-a", Node: "node-a"}, "not-node-agent"},
	} {
		_, err := a.Allowed(nil, tc.caller)
		var r *refusalError
		switch {
		case tc.reason == "" && err != nil:
			t.Errorf("%s: %v", name, err)
		case tc.reason != "" && (!errors.As(err, &r) || r.reason != tc.reason):
			t.Errorf("%s: %v, want %s", name, err, tc.reason)
		}
	}
}
