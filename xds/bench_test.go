// SPDX-License-Identifier: Apache-2.0

package xds

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"runtime"
	"slices"
	"testing"
	"time"

	"github.com/cilium/statedb"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	cachetypes "github.com/envoyproxy/go-control-plane/pkg/cache/types"
	cache "github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	xdsserver "github.com/envoyproxy/go-control-plane/pkg/server/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/protobuf/proto"
	"istio.io/istio/pkg/workloadapi"

	"github.com/mtlsbridge/mtlsbridge/grpcserver"
	"github.com/mtlsbridge/mtlsbridge/identity"
	"github.com/mtlsbridge/mtlsbridge/internal/heapstat"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/workload"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// The xDS benchmarks run mtlsbridge's server and go-control-plane's
// LinearCache on the same workloads, each behind a real gRPC server with
// TLS on loopback, with the same wildcard delta client:
//
//	initial:  time from subscribe to the last resource of the snapshot
//	change:   time from committing one pod change to the client receiving
//	          it (p50, p99 over 200 changes)
//	B/workload: heap held by the workloads and the server with one client
//
// Run: go test -run '^$' -bench 'XDS' -benchtime 3x ./xds/

// acceptAll stands in for the listener's tap, which the benchmark's bare
// gRPC server lacks.
func acceptAll(context.Context) (grpcserver.Caller, error) {
	return grpcserver.Caller{Namespace: "kube-system", Pod: "ztunnel-a"}, nil
}

func benchPod(i int, gen int) *tables.Pod {
	return &tables.Pod{
		Namespace: fmt.Sprintf("ns-%d", i%1000), Name: fmt.Sprintf("pod-%d-%d", i, gen),
		NodeName: fmt.Sprintf("node-%d", i%1000), ServiceAccount: "sa",
		Labels:        tables.NewLabels(map[string]string{"app": fmt.Sprintf("app-%d", i%10)}),
		IPs:           []netip.Addr{netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)})},
		RedirectReady: true,
	}
}

// tlsPair gives a server certificate and a client pool from a fresh CA.
func tlsPair(b *testing.B) (*tls.Config, *tls.Config) {
	certPEM, keyPEM, err := identity.NewRootMaterial("cluster.local", time.Hour)
	if err != nil {
		b.Fatal(err)
	}
	m, err := identity.ParseMaterial(certPEM, keyPEM, nil)
	if err != nil {
		b.Fatal(err)
	}
	a := &identity.Authority{}
	a.Set(m, nil)
	cert, err := a.ServingCertificate([]string{"127.0.0.1"})
	if err != nil {
		b.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(certPEM)
	return &tls.Config{Certificates: []tls.Certificate{*cert}, NextProtos: []string{"h2"}}, &tls.Config{RootCAs: pool}
}

// serve runs register on a TLS gRPC server on loopback and returns a client.
func serve(b *testing.B, register func(*grpc.Server)) discovery.AggregatedDiscoveryServiceClient {
	serverTLS, clientTLS := tlsPair(b)
	srv := grpc.NewServer(grpc.Creds(credentials.NewTLS(serverTLS)), grpc.MaxRecvMsgSize(64<<20), grpc.MaxSendMsgSize(64<<20))
	register(srv)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	go srv.Serve(l)
	b.Cleanup(srv.Stop)
	conn, err := grpc.NewClient(l.Addr().String(), grpc.WithTransportCredentials(credentials.NewTLS(clientTLS)),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(64<<20)))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { conn.Close() })
	return discovery.NewAggregatedDiscoveryServiceClient(conn)
}

// benchClient subscribes as wildcard and counts what arrives.
type benchClient struct {
	stream discovery.AggregatedDiscoveryService_DeltaAggregatedResourcesClient
	cancel context.CancelFunc
}

// subscribeAll subscribes to every workload and receives the initial
// snapshot of n resources.
func subscribeAll(b *testing.B, c discovery.AggregatedDiscoveryServiceClient, n int) *benchClient {
	ctx, cancel := context.WithCancel(context.Background())
	stream, err := c.DeltaAggregatedResources(ctx)
	if err != nil {
		b.Fatal(err)
	}
	if err := stream.Send(&discovery.DeltaDiscoveryRequest{TypeUrl: AddressType}); err != nil {
		b.Fatal(err)
	}
	client := &benchClient{stream: stream, cancel: cancel}
	got := 0
	client.until(b, func(resp *discovery.DeltaDiscoveryResponse) bool {
		got += len(resp.Resources)
		return got >= n
	})
	return client
}

// until receives (and ACKs) responses until done says so.
func (c *benchClient) until(b *testing.B, done func(*discovery.DeltaDiscoveryResponse) bool) {
	for {
		resp, err := c.stream.Recv()
		if err != nil {
			b.Fatal(err)
		}
		c.stream.Send(&discovery.DeltaDiscoveryRequest{TypeUrl: resp.TypeUrl, ResponseNonce: resp.Nonce})
		if done(resp) {
			return
		}
	}
}

// backend is one xDS implementation under test.
type backend interface {
	client(b *testing.B) discovery.AggregatedDiscoveryServiceClient
	// change replaces workload i's resource and returns its name.
	change(b *testing.B, i, gen int) string
}

// mtlsbridge: the workloads table and the stream per client.
type tableBackend struct {
	db        *statedb.DB
	workloads statedb.RWTable[*workload.Workload]
}

func newTableBackend(b *testing.B, n int) *tableBackend {
	db := statedb.New()
	wl, err := workload.NewTable(db)
	if err != nil {
		b.Fatal(err)
	}
	txn := db.WriteTxn(wl)
	for i := range n {
		w, err := workload.New("Kubernetes", "cluster.local", benchPod(i, 0), true)
		if err != nil {
			b.Fatal(err)
		}
		wl.Insert(txn, w)
	}
	txn.Commit()
	return &tableBackend{db: db, workloads: wl}
}

func (t *tableBackend) client(b *testing.B) discovery.AggregatedDiscoveryServiceClient {
	clients, err := NewClientsTable(t.db)
	if err != nil {
		b.Fatal(err)
	}
	acks, err := NewAcksTable(t.db)
	if err != nil {
		b.Fatal(err)
	}
	pods, err := tables.NewPodsTable(t.db)
	if err != nil {
		b.Fatal(err)
	}
	s := &server{
		serverParams: serverParams{
			Config: Config{XDSCoalesce: time.Millisecond, XDSSendTimeout: time.Minute, XDSMaxResourcesPerResponse: defaultConfig.XDSMaxResourcesPerResponse},
			Log:    slog.New(slog.DiscardHandler), Metrics: newMetrics(prometheus.NewRegistry()),
			DB: t.db, Workloads: t.workloads, Clients: clients, Acks: acks, Pods: pods, WorkloadConfig: workload.Config{ClusterID: "Kubernetes"},
		},
		auth: acceptAll,
	}
	return serve(b, func(srv *grpc.Server) { discovery.RegisterAggregatedDiscoveryServiceServer(srv, s) })
}

// change gives workload i new content: its canonical revision ("version"
// label) becomes gen.
func (t *tableBackend) change(b *testing.B, i, gen int) string {
	pod := benchPod(i, 0)
	pod.Labels = tables.NewLabels(map[string]string{"app": "changed", "version": fmt.Sprint(gen)})
	w, err := workload.New("Kubernetes", "cluster.local", pod, true)
	if err != nil {
		b.Fatal(err)
	}
	txn := t.db.WriteTxn(t.workloads)
	t.workloads.Insert(txn, w)
	txn.Commit()
	return w.UID
}

// go-control-plane's LinearCache with the same resources.
type linearBackend struct {
	cache *cache.LinearCache
}

func linearResource(i, gen int, changed bool) (string, cachetypes.Resource) {
	pod := benchPod(i, 0)
	if changed {
		pod.Labels = tables.NewLabels(map[string]string{"app": "changed", "version": fmt.Sprint(gen)})
	}
	w, _ := workload.New("Kubernetes", "cluster.local", pod, true)
	var addr workloadapi.Address
	proto.Unmarshal(w.Resource, &addr)
	return w.UID, &addr
}

func newLinearBackend(b *testing.B, n int) *linearBackend {
	resources := make(map[string]cachetypes.Resource, n)
	for i := range n {
		name, r := linearResource(i, 0, false)
		resources[name] = r
	}
	return &linearBackend{cache: cache.NewLinearCache(AddressType, cache.WithInitialResources(resources))}
}

func (l *linearBackend) client(b *testing.B) discovery.AggregatedDiscoveryServiceClient {
	s := xdsserver.NewServer(context.Background(), l.cache, nil)
	return serve(b, func(srv *grpc.Server) { discovery.RegisterAggregatedDiscoveryServiceServer(srv, s) })
}

func (l *linearBackend) change(b *testing.B, i, gen int) string {
	name, r := linearResource(i, gen, true)
	if err := l.cache.UpdateResource(name, r); err != nil {
		b.Fatal(err)
	}
	return name
}

var benchSizes = []int{1_000, 10_000, 100_000}

var backends = []struct {
	name string
	new  func(*testing.B, int) backend
}{
	{"mtlsbridge", func(b *testing.B, n int) backend { return newTableBackend(b, n) }},
	{"linearcache", func(b *testing.B, n int) backend { return newLinearBackend(b, n) }},
}

// BenchmarkXDSInitialSnapshot: time to deliver every workload to a newly
// subscribed wildcard client.
func BenchmarkXDSInitialSnapshot(b *testing.B) {
	for _, n := range benchSizes {
		for _, be := range backends {
			b.Run(fmt.Sprintf("%s/%d", be.name, n), func(b *testing.B) {
				back := be.new(b, n)
				client := back.client(b)
				for b.Loop() {
					c := subscribeAll(b, client, n)
					c.cancel()
				}
			})
		}
	}
}

// BenchmarkXDSChangeLatency: one pod change to its delta at the client.
func BenchmarkXDSChangeLatency(b *testing.B) {
	const changes = 200
	for _, n := range benchSizes {
		for _, be := range backends {
			b.Run(fmt.Sprintf("%s/%d", be.name, n), func(b *testing.B) {
				back := be.new(b, n)
				client := back.client(b)
				var latencies []time.Duration
				gen := 0 // each change is new content, across rounds too
				for b.Loop() {
					c := subscribeAll(b, client, n)
					for k := range changes {
						// Space changes beyond the coalescing window so that
						// each is a push of its own.
						time.Sleep(2 * time.Millisecond)
						start := time.Now()
						gen++
						name := back.change(b, (k*7919)%n, gen)
						c.until(b, func(resp *discovery.DeltaDiscoveryResponse) bool {
							return slices.ContainsFunc(resp.Resources, func(r *discovery.Resource) bool { return r.Name == name })
						})
						latencies = append(latencies, time.Since(start))
					}
					c.cancel()
				}
				slices.Sort(latencies)
				b.ReportMetric(float64(latencies[len(latencies)/2].Microseconds()), "p50-us")
				b.ReportMetric(float64(latencies[len(latencies)*99/100].Microseconds()), "p99-us")
			})
		}
	}
}

// BenchmarkXDSMemory: heap per workload held by the workloads and the server
// serving one wildcard client that holds them all.
func BenchmarkXDSMemory(b *testing.B) {
	for _, be := range backends {
		b.Run(fmt.Sprintf("%s/100000", be.name), func(b *testing.B) {
			const n = 100_000
			var perWorkload float64
			for b.Loop() {
				perWorkload = heapPerWorkload(b, func() (any, func()) {
					back := be.new(b, n)
					client := back.client(b)
					c := subscribeAll(b, client, n)
					return back, c.cancel
				}, n)
			}
			b.ReportMetric(perWorkload, "B/workload")
		})
	}
}

func heapPerWorkload(b *testing.B, build func() (any, func()), n int) float64 {
	heap := heapstat.Settled
	before := heap()
	held, stop := build()
	// Let the server settle (its last responses are out).
	time.Sleep(100 * time.Millisecond)
	after := heap()
	runtime.KeepAlive(held)
	stop()
	return float64(after-before) / float64(n)
}
