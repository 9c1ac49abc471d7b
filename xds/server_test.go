// SPDX-License-Identifier: Apache-2.0

package xds

import (
	"context"
	"log/slog"
	"net/netip"
	"testing"
	"time"

	"github.com/cilium/statedb"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"

	"github.com/mtlsbridge/mtlsbridge/reconcilers/workload"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// A client that reconnects while the workloads table is not yet derived
// from a full view (the agent has just restarted) is answered only once it
// is: answered at once, it would be told that the workloads it holds are
// removed, and ztunnel sends to a destination it does not know without
// mTLS.
func TestAnswerWaitsForTheDerivedTable(t *testing.T) {
	db := statedb.New()
	workloads, err := workload.NewTable(db)
	must(t, err)
	pods, err := tables.NewPodsTable(db, tables.LocalNode{NodeName: "node-a"})
	must(t, err)
	wtxn := db.WriteTxn(workloads)
	derived := workloads.RegisterInitializer(wtxn, "test")
	wtxn.Commit()
	s := newTestServer(t, db, workloads, pods, "node-a",
		Config{XDSCoalesce: time.Millisecond, XDSSendTimeout: time.Minute, XDSMaxResourcesPerResponse: 100, XDSMaxNames: 100, XDSMaxStreams: 1})
	client := serve(t, func(srv *grpc.Server) { srv.RegisterService(serviceDesc(), s) })

	web, err := workload.New("Kubernetes", "cluster.local", &tables.Pod{Namespace: "app", Name: "web", NodeName: "node-b",
		IPs: []netip.Addr{netip.MustParseAddr("10.0.2.10")}, RedirectReady: true}, true)
	must(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	stream, err := client.DeltaAggregatedResources(ctx)
	must(t, err)
	must(t, stream.Send(&discovery.DeltaDiscoveryRequest{TypeUrl: AddressType,
		InitialResourceVersions: map[string]string{web.UID(): web.VersionString()}}))
	answers := make(chan *discovery.DeltaDiscoveryResponse, 1)
	go func() {
		resp, err := stream.Recv()
		if err != nil {
			close(answers)
			return
		}
		answers <- resp
	}()
	select {
	case resp := <-answers:
		t.Fatalf("answered before the table was derived: %v", resp)
	case <-time.After(200 * time.Millisecond):
	}

	wtxn = db.WriteTxn(workloads)
	workloads.Insert(wtxn, web)
	derived(wtxn)
	wtxn.Commit()
	select {
	case resp, ok := <-answers:
		if !ok {
			t.Fatal("stream ended without an answer")
		}
		if len(resp.Resources) != 0 || len(resp.RemovedResources) != 0 {
			t.Errorf("answer: %d resources, removed %q; want nothing: the client holds web as it is", len(resp.Resources), resp.RemovedResources)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no answer once the table was derived")
	}
}

// newTestServer is a server of db's workloads and pods on node, with the
// other tables it reads, empty, and every caller accepted.
func newTestServer(t testing.TB, db *statedb.DB, workloads statedb.Table[*workload.Workload], pods statedb.Table[*tables.Pod], node string, cfg Config) *server {
	cniPods, err := tables.NewCNIPodsTable(db)
	must(t, err)
	clients, err := NewClientsTable(db)
	must(t, err)
	acks, err := NewAcksTable(db)
	must(t, err)
	return &server{
		serverParams: serverParams{
			Config: cfg, Log: slog.New(slog.DiscardHandler), Metrics: newMetrics(prometheus.NewRegistry()),
			DB: db, Workloads: workloads, Pods: pods, CNIPods: cniPods, Clients: clients, Acks: acks,
			WorkloadConfig: workload.Config{ClusterID: "Kubernetes"}, Node: tables.LocalNode{NodeName: node},
		},
		auth: acceptAll, buffers: newResponseBuffers(),
	}
}
