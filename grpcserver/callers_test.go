// SPDX-License-Identifier: Apache-2.0

package grpcserver

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/cilium/statedb"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/tap"

	"github.com/mtlsbridge/mtlsbridge/internal/logthrottle"
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

// At the signer, one node's agent has at most perNodeCalls calls open, so
// that a compromised node cannot hold every slot of the others; a call
// gives its place back when it ends, or when the tap refuses it after all.
func TestSignerCallsPerNode(t *testing.T) {
	const method = "/istio.v1.auth.IstioCertificateService/CreateCertificate"
	a := &Authenticator{
		callers: Callers{NodeAgents: []string{"kube-system/cilium"}},
		db:      statedb.New(), metrics: newMetrics(prometheus.NewRegistry()), log: slog.New(slog.DiscardHandler),
		logs:  logthrottle.New(time.Second),
		slots: map[string]chan struct{}{method: make(chan struct{}, perNodeCalls+1)},
		verify: func(_ context.Context, token string) (Caller, error) {
			return Caller{Namespace: "kube-system", Pod: "cilium-" + token, ServiceAccount: "cilium", Node: "node-" + token}, nil
		},
	}
	call := func(node string) (context.CancelFunc, error) {
		ctx, cancel := context.WithCancel(context.Background())
		_, err := a.Tap(ctx, &tap.Info{FullMethodName: method, Header: metadata.Pairs("authorization", "Bearer "+node)})
		return cancel, err
	}
	var open []context.CancelFunc
	for range perNodeCalls {
		end, err := call("a")
		if err != nil {
			t.Fatalf("call of node-a within its share: %v", err)
		}
		open = append(open, end)
	}
	if _, err := call("a"); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("one call more of node-a: %v, want ResourceExhausted", err)
	}
	endB, err := call("b")
	if err != nil {
		t.Fatalf("node-b while node-a holds its share: %v", err)
	}
	openOf := func(node string) int {
		a.nodeCalls.mu.Lock()
		defer a.nodeCalls.mu.Unlock()
		return a.nodeCalls.open[node]
	}
	waitFor := func(what string, cond func() bool) {
		for deadline := time.Now().Add(5 * time.Second); !cond(); time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%s: not in time", what)
			}
		}
	}
	// The method's slots are full now: node-c is refused, and its node
	// share is given back at once.
	if _, err := call("c"); status.Code(err) != codes.ResourceExhausted || openOf("node-c") != 0 {
		t.Fatalf("node-c with the method's slots full: %v, %d calls held, want ResourceExhausted and none", err, openOf("node-c"))
	}
	endB()
	waitFor("node-b's call given back", func() bool { return openOf("node-b") == 0 && len(a.slots[method]) == perNodeCalls })
	endC, err := call("c")
	if err != nil {
		t.Fatalf("node-c once node-b's call ended: %v", err)
	}
	defer endC()
	open[0]()
	waitFor("node-a's ended call given back", func() bool { return openOf("node-a") == perNodeCalls-1 })
	defer open[1]()
}
