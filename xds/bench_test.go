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
	"runtime/trace"
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
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
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
func tlsPair(b testing.TB) (*tls.Config, *tls.Config) {
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
func serve(b testing.TB, register func(*grpc.Server)) discovery.AggregatedDiscoveryServiceClient {
	serverTLS, clientTLS := tlsPair(b)
	srv := grpc.NewServer(grpc.Creds(credentials.NewTLS(serverTLS)), grpc.MaxRecvMsgSize(64<<20), grpc.MaxSendMsgSize(64<<20),
		grpcserver.CodecOption())
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

// benchClient subscribes as wildcard and reads what arrives. It reads
// responses as bytes and walks their wire form (scanCodec) instead of
// decoding them into messages: the benchmarks time the server, gRPC and
// TLS, not Go's protobuf decoding in the client, which alone costs about
// 2.5 ms per MB here (BenchmarkXDSFloor/decode; ztunnel decodes in Rust).
type benchClient struct {
	stream discovery.AggregatedDiscoveryService_DeltaAggregatedResourcesClient
	cancel context.CancelFunc
	// keep: responses are kept whole, for their names (scanned.each).
	keep bool
}

// scanned is a response as the benchmark client sees it.
type scanned struct {
	// keep asks to keep raw, for each.
	keep    bool
	raw     []byte
	typeURL string
	nonce   string
	// resources counts the resources, removed the removed names.
	resources, removed int
}

// each calls fn with each resource's name and version.
func (s *scanned) each(fn func(name, version []byte)) {
	walk(s.raw, func(num protowire.Number, v []byte) {
		if num != 2 {
			return
		}
		var name, version []byte
		walk(v, func(num protowire.Number, v []byte) {
			switch num {
			case 1:
				version = v
			case 3:
				name = v
			}
		})
		fn(name, version)
	})
}

// walk calls fn with each length-delimited field of a message.
func walk(b []byte, fn func(protowire.Number, []byte)) {
	err := fields(oneBuffer(b), func(f field) error {
		if f.typ == protowire.BytesType {
			fn(f.num, f.value())
		}
		return nil
	})
	if err != nil {
		panic(err)
	}
}

// scanCodec is gRPC's proto codec, except that it hands a *scanned its
// response's bytes.
type scanCodec struct{ encoding.CodecV2 }

// encoded is a message already marshalled.
type encoded []byte

func (c scanCodec) Marshal(v any) (mem.BufferSlice, error) {
	if e, ok := v.(encoded); ok {
		return mem.BufferSlice{mem.SliceBuffer(e)}, nil
	}
	return c.CodecV2.Marshal(v)
}

func (c scanCodec) Unmarshal(data mem.BufferSlice, v any) error {
	s, ok := v.(*scanned)
	if !ok {
		return c.CodecV2.Unmarshal(data, v)
	}
	// Only a response whose names are read is kept; the others go back
	// to gRPC's pool, so that the client's garbage does not weigh on the
	// server's collections.
	buf := data.MaterializeToBuffer(mem.DefaultBufferPool())
	defer buf.Free()
	raw := buf.ReadOnlyData()
	if s.keep {
		s.raw = slices.Clone(raw)
	}
	walk(raw, func(num protowire.Number, v []byte) {
		switch num {
		case 2:
			s.resources++
		case 4:
			s.typeURL = string(v)
		case 5:
			s.nonce = string(v)
		case 6:
			s.removed++
		}
	})
	return nil
}

// open starts a stream and sends its first request (a message, or
// encoded).
func open(b *testing.B, c discovery.AggregatedDiscoveryServiceClient, first any) *benchClient {
	ctx, cancel := context.WithCancel(context.Background())
	stream, err := c.DeltaAggregatedResources(ctx, grpc.ForceCodecV2(scanCodec{encoding.GetCodecV2("proto")}))
	if err != nil {
		b.Fatal(err)
	}
	if err := stream.SendMsg(first); err != nil {
		b.Fatal(err)
	}
	return &benchClient{stream: stream, cancel: cancel}
}

// subscribeAll subscribes to every workload and receives the initial
// snapshot of n resources; versions, when not nil, gets their versions.
func subscribeAll(b *testing.B, c discovery.AggregatedDiscoveryServiceClient, n int, versions map[string]string) *benchClient {
	client := open(b, c, &discovery.DeltaDiscoveryRequest{TypeUrl: AddressType})
	client.keep = versions != nil
	got := 0
	client.until(b, func(resp *scanned) bool {
		got += resp.resources
		if versions != nil {
			resp.each(func(name, version []byte) { versions[string(name)] = string(version) })
		}
		return got >= n
	})
	return client
}

// until receives (and ACKs) responses until done says so.
func (c *benchClient) until(b *testing.B, done func(*scanned) bool) {
	for {
		resp := scanned{keep: c.keep}
		if err := c.stream.RecvMsg(&resp); err != nil {
			b.Fatal(err)
		}
		finished := done(&resp)
		c.stream.Send(&discovery.DeltaDiscoveryRequest{TypeUrl: resp.typeURL, ResponseNonce: resp.nonce})
		if finished {
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
	// digest and digests are kept as the derivation keeps them.
	digest  workload.Digest
	digests *workload.Digests
}

func newTableBackend(b *testing.B, n int) *tableBackend {
	db := statedb.New()
	wl, err := workload.NewTable(db)
	if err != nil {
		b.Fatal(err)
	}
	t := &tableBackend{db: db, workloads: wl, digests: workload.NewDigests()}
	txn := db.WriteTxn(wl)
	for i := range n {
		w, err := workload.New("Kubernetes", "cluster.local", benchPod(i, 0), true)
		if err != nil {
			b.Fatal(err)
		}
		wl.Insert(txn, w)
		t.digest.Add(w)
	}
	t.digests.Publish(wl.Revision(txn.Commit()), t.digest)
	return t
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
	pods, err := tables.NewPodsTable(t.db, tables.LocalNode{})
	if err != nil {
		b.Fatal(err)
	}
	s := &server{
		serverParams: serverParams{
			Config: Config{XDSCoalesce: time.Millisecond, XDSSendTimeout: time.Minute, XDSMaxResourcesPerResponse: defaultConfig.XDSMaxResourcesPerResponse, XDSMaxNames: defaultConfig.XDSMaxNames, XDSMaxStreams: defaultConfig.XDSMaxStreams},
			Log:    slog.New(slog.DiscardHandler), Metrics: newMetrics(prometheus.NewRegistry()),
			DB: t.db, Workloads: t.workloads, Digests: t.digests, Clients: clients, Acks: acks, Pods: pods, WorkloadConfig: workload.Config{ClusterID: "Kubernetes"},
		},
		auth: acceptAll, buffers: newResponseBuffers(),
	}
	return serve(b, func(srv *grpc.Server) { srv.RegisterService(serviceDesc(), s) })
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
	if old, _, found := t.workloads.Get(txn, workload.ByUID(w.UID())); found {
		t.digest.Remove(old)
	}
	t.workloads.Insert(txn, w)
	t.digest.Add(w)
	t.digests.Publish(t.workloads.Revision(txn.Commit()), t.digest)
	return w.UID()
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
	proto.Unmarshal([]byte(w.Resource), &addr)
	return w.UID(), &addr
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
					c := subscribeAll(b, client, n, nil)
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
					c := subscribeAll(b, client, n, nil)
					c.keep = true
					for k := range changes {
						// Space changes beyond the coalescing window so that
						// each is a push of its own.
						time.Sleep(2 * time.Millisecond)
						start := time.Now()
						gen++
						// Marks for the breakdown of a trace (-test.trace).
						trace.Log(context.Background(), "xds-bench", "commit")
						name := back.change(b, (k*7919)%n, gen)
						trace.Log(context.Background(), "xds-bench", "committed")
						// The clock stops when the change arrives, before
						// the client acknowledges it.
						c.until(b, func(resp *scanned) bool {
							found := false
							resp.each(func(got, _ []byte) { found = found || string(got) == name })
							if found {
								latencies = append(latencies, time.Since(start))
								trace.Log(context.Background(), "xds-bench", "received")
							}
							return found
						})
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

// BenchmarkXDSReconnect: a client that held every workload reconnects with
// initial_resource_versions for all of them: time from opening the stream
// (its request already encoded) to the end of the server's answer, and the
// resources resent (resent/op: none when nothing changed, only the changed
// ones otherwise; unchanged-resent/op counts those the client held as they
// are). p50-ms is the median round beside ns/op's mean. go-control-plane answers nothing when nothing changed, so
// its unchanged case has no end of answer to time and is skipped.
func BenchmarkXDSReconnect(b *testing.B) {
	const n = 100_000
	for _, changedPct := range []int{0, 1} {
		for _, be := range backends {
			b.Run(fmt.Sprintf("%s/%d/changed=%d%%", be.name, n, changedPct), func(b *testing.B) {
				if changedPct == 0 && be.name == "linearcache" {
					b.Skip("go-control-plane sends no answer when nothing changed")
				}
				back := be.new(b, n)
				client := back.client(b)
				versions := map[string]string{}
				subscribeAll(b, client, n, versions).cancel()
				changed := n * changedPct / 100
				resent, unchanged, gen := 0, 0, 0
				var took []time.Duration
				b.ResetTimer()
				for round := 0; round < b.N; round++ {
					b.StopTimer()
					changedUIDs := map[string]bool{}
					for k := range changed {
						gen++
						changedUIDs[back.change(b, (k*(100/changedPct)+round)%n, gen)] = true
					}
					// Encoded before the clock runs: the client's cost.
					req, err := proto.Marshal(&discovery.DeltaDiscoveryRequest{TypeUrl: AddressType, InitialResourceVersions: versions})
					if err != nil {
						b.Fatal(err)
					}
					// The client's work between rounds (encoding the claims,
					// reading the answer) leaves tens of MB of garbage that a
					// server does not share: collected before the clock runs,
					// so that a collection during the round is the server's.
					runtime.GC()
					b.StartTimer()
					start := time.Now()
					c := open(b, client, encoded(req))
					c.keep = true
					var answer []*scanned
					got := 0
					c.until(b, func(resp *scanned) bool {
						answer = append(answer, resp)
						got += resp.resources
						return got >= changed
					})
					b.StopTimer()
					took = append(took, time.Since(start))
					c.cancel()
					resent += got
					// The client now holds the changed ones as they are.
					for _, resp := range answer {
						resp.each(func(name, version []byte) {
							if !changedUIDs[string(name)] {
								unchanged++
							}
							versions[string(name)] = string(version)
						})
					}
					b.StartTimer()
				}
				slices.Sort(took)
				b.ReportMetric(float64(took[len(took)/2].Microseconds())/1000, "p50-ms")
				b.ReportMetric(float64(resent)/float64(b.N), "resent/op")
				b.ReportMetric(float64(unchanged)/float64(b.N), "unchanged-resent/op")
			})
		}
	}
}

// BenchmarkXDSMemory: heap per workload held by the workloads and the server
// serving one wildcard client that holds them all (resources-B/workload:
// the resources alone, with nothing served). For mtlsbridge, the floor
// under that: statedb-B/row, what the workloads table adds to rows built
// beforehand (its radix trees: the uid index's and the revision index's),
// and encoded-B/workload, the resources' mean length.
func BenchmarkXDSMemory(b *testing.B) {
	b.Run("statedb-floor/100000", func(b *testing.B) {
		const n = 100_000
		var perRow, encoded float64
		for b.Loop() {
			rows := make([]*workload.Workload, n)
			total := 0
			for i := range rows {
				w, err := workload.New("Kubernetes", "cluster.local", benchPod(i, 0), true)
				if err != nil {
					b.Fatal(err)
				}
				rows[i], total = w, total+len(w.Resource)
			}
			encoded = float64(total) / n
			perRow = heapPerWorkload(b, func() (any, func()) {
				db := statedb.New()
				wl, err := workload.NewTable(db)
				if err != nil {
					b.Fatal(err)
				}
				txn := db.WriteTxn(wl)
				for _, w := range rows {
					wl.Insert(txn, w)
				}
				txn.Commit()
				return db, func() {}
			}, n)
			runtime.KeepAlive(rows)
		}
		b.ReportMetric(perRow, "statedb-B/row")
		b.ReportMetric(encoded, "encoded-B/workload")
	})
	for _, be := range backends {
		b.Run(fmt.Sprintf("%s/100000", be.name), func(b *testing.B) {
			const n = 100_000
			var perWorkload, table float64
			for b.Loop() {
				perWorkload = heapPerWorkload(b, func() (any, func()) {
					back := be.new(b, n)
					client := back.client(b)
					c := subscribeAll(b, client, n, nil)
					return back, c.cancel
				}, n)
				// The resources alone (for mtlsbridge, the workloads table),
				// a part of the agent's heap of all tables per pod.
				table = heapPerWorkload(b, func() (any, func()) { return be.new(b, n), func() {} }, n)
			}
			b.ReportMetric(perWorkload, "B/workload")
			b.ReportMetric(table, "resources-B/workload")
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
