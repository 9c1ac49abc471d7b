// SPDX-License-Identifier: Apache-2.0

package bypass_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc/metadata"

	"github.com/mtlsbridge/mtlsbridge/internal/agenttest"
	"github.com/mtlsbridge/mtlsbridge/internal/netnstest"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/bypass"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// TestBypassUntilAcked runs the whole agent with its datapath on node-a:
// a pod fully redirected still bypasses until the mTLS agent has
// acknowledged its Workload with HBONE, and again once the agent's stream
// is gone.
func TestBypassUntilAcked(t *testing.T) {
	netnstest.RequirePrivileged(t)
	bpfRoot := netnstest.BPFRoot(t)
	node1, _ := netnstest.NewNodes(t)
	ztunnel := node1.AddPod(t, "ztunnel")
	ztunnel.MakeAgent(t)
	a := node1.AddPod(t, "a")

	manifests := t.TempDir()
	doc := func(name, ns, labels string, ips ...fmt.Stringer) string {
		var s []string
		for _, ip := range ips {
			s = append(s, fmt.Sprintf("{ip: %q}", ip))
		}
		return fmt.Sprintf("apiVersion: v1\nkind: Pod\nmetadata: {name: %s, namespace: %s, labels: {%s}}\n"+
			"spec: {nodeName: node-a, serviceAccountName: %s}\nstatus: {phase: Running, podIPs: [%s]}\n",
			name, ns, labels, name, strings.Join(s, ", "))
	}
	docs := []string{
		"apiVersion: v1\nkind: Node\nmetadata: {name: node-a}\nstatus: {addresses: [{type: InternalIP, address: 192.168.100.1}]}\n",
		"apiVersion: v1\nkind: Namespace\nmetadata: {name: app}\n",
		"apiVersion: v1\nkind: Namespace\nmetadata: {name: kube-system}\n",
		doc("ztunnel-a", "kube-system", tables.RedirTypeLabel+": "+tables.RedirTypeProxy, ztunnel.IP4, ztunnel.IP6),
		doc("a", "app", tables.RedirTypeLabel+": "+tables.RedirTypeWorkload, a.IP4, a.IP6),
	}
	must(t, os.WriteFile(filepath.Join(manifests, "cluster.yaml"), []byte(strings.Join(docs, "---\n")), 0o644))

	ag := &agent{}
	run := agenttest.Start(t, manifests,
		[]cell.Cell{cell.Invoke(func(c *bypass.Checker, tbl statedb.Table[*bypass.Bypass], db *statedb.DB) {
			ag.checker, ag.table, ag.db = c, tbl, db
		})},
		"--enable-redirect=true",
		"--bpf-root="+filepath.Join(bpfRoot, "agent"),
		"--node-netns=/var/run/netns/"+node1.Name,
		"--devices="+netnstest.UplinkName,
	)
	ag.metrics, ag.stateDir = run.Metrics, run.StateDir
	const pod = "app/a"
	const uid = "Kubernetes//Pod/app/a"

	// Step 1: the datapath is in place, but no mTLS agent holds the
	// Workload: the only gap is xDS.
	r := ag.waitRow(t, "only the xDS gap", pod, func(r *bypass.Bypass) bool {
		return len(r.Gaps) == 1 && r.Gaps[0] == bypass.GapNotAcked
	})
	t.Logf("before ACK: %q", r.Gaps)

	// Step 2: the mTLS agent subscribes; the response alone is not
	// enough, its ACK is.
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer tok-a", "clusterid", "Kubernetes")
	stream, err := discovery.NewAggregatedDiscoveryServiceClient(run.Dial(t)).DeltaAggregatedResources(ctx)
	must(t, err)
	must(t, stream.Send(&discovery.DeltaDiscoveryRequest{TypeUrl: "type.googleapis.com/istio.workload.Address",
		Node: &core.Node{Id: "ztunnel~" + ztunnel.IP4.String() + "~ztunnel-a.kube-system~kube-system.svc.cluster.local"}}))
	resp, err := stream.Recv()
	must(t, err)
	if !hasResource(resp, uid) {
		t.Fatalf("snapshot without %s: %v", uid, resp)
	}
	if rows, err := ag.checker.Check(); err != nil || len(rows) != 1 || !rows[0].Bypassing {
		t.Fatalf("before the ACK: %v %s, want %s bypassing", err, show(rows), pod)
	}
	// ACK this response and every later one (a's Workload may come again
	// once its redirect is Done, now with HBONE), as ztunnel does.
	done := make(chan struct{})
	go func(r *discovery.DeltaDiscoveryResponse) {
		defer close(done)
		for {
			if stream.Send(&discovery.DeltaDiscoveryRequest{TypeUrl: r.TypeUrl, ResponseNonce: r.Nonce}) != nil {
				return
			}
			next, err := stream.Recv()
			if err != nil {
				return
			}
			r = next
		}
	}(resp)
	ag.waitClean(t, pod)

	// Step 3: the stream goes, and with it what it acknowledged.
	cancel()
	<-done
	ag.waitGap(t, pod, bypass.GapNotAcked)
}

func hasResource(resp *discovery.DeltaDiscoveryResponse, name string) bool {
	for _, r := range resp.Resources {
		if r.Name == name {
			return true
		}
	}
	return false
}
