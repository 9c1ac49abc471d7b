// SPDX-License-Identifier: Apache-2.0

package xds_test

import (
	"context"
	"fmt"
	"maps"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
	"istio.io/istio/pkg/workloadapi"

	"github.com/mtlsbridge/mtlsbridge/api/client"
	"github.com/mtlsbridge/mtlsbridge/cni/plugin"
	"github.com/mtlsbridge/mtlsbridge/internal/agenttest"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/workload"
	"github.com/mtlsbridge/mtlsbridge/xds"
)

const (
	webUID = "Kubernetes//Pod/app/web"
	apiUID = "Kubernetes//Pod/app/api"
)

// ztunnel behaves like ztunnel's xDS client: TLS, a bearer token, node
// metadata on the first request of each type, ACKs.
type ztunnel struct {
	t      *testing.T
	stream discovery.AggregatedDiscoveryService_DeltaAggregatedResourcesClient
	cancel context.CancelFunc
	resps  chan *discovery.DeltaDiscoveryResponse
	errs   chan error
}

func connect(t *testing.T, a *agenttest.Agent, token string) (*ztunnel, error) {
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	if token != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token, "clusterid", "Kubernetes")
	}
	stream, err := discovery.NewAggregatedDiscoveryServiceClient(a.Dial(t)).DeltaAggregatedResources(ctx)
	if err != nil {
		return nil, err
	}
	z := &ztunnel{t: t, stream: stream, cancel: cancel, resps: make(chan *discovery.DeltaDiscoveryResponse, 100), errs: make(chan error, 1)}
	go func() {
		for {
			resp, err := stream.Recv()
			if err != nil {
				z.errs <- err
				return
			}
			z.resps <- resp
		}
	}()
	return z, nil
}

var node = &core.Node{
	Id: "ztunnel~10.0.1.2~ztunnel-a.kube-system~kube-system.svc.cluster.local",
	Metadata: &structpb.Struct{Fields: map[string]*structpb.Value{
		"NAME": structpb.NewStringValue("ztunnel-a"), "NAMESPACE": structpb.NewStringValue("kube-system"),
		"NODE_NAME": structpb.NewStringValue("node-a"), "CLUSTER_ID": structpb.NewStringValue("Kubernetes"),
	}},
}

func (z *ztunnel) send(req *discovery.DeltaDiscoveryRequest) {
	z.t.Helper()
	if err := z.stream.Send(req); err != nil {
		z.t.Fatalf("send: %v", err)
	}
}

// subscribe sends the first request of a type: wildcard, or on demand.
func (z *ztunnel) subscribe(typeURL string, held map[string]string, onDemand bool) {
	req := &discovery.DeltaDiscoveryRequest{Node: node, TypeUrl: typeURL, InitialResourceVersions: held}
	if onDemand {
		req.ResourceNamesSubscribe = []string{"*"}
		req.ResourceNamesUnsubscribe = []string{"*"}
	}
	z.send(req)
}

func (z *ztunnel) recv() *discovery.DeltaDiscoveryResponse {
	z.t.Helper()
	select {
	case resp := <-z.resps:
		return resp
	case err := <-z.errs:
		z.t.Fatalf("stream ended: %v", err)
	case <-time.After(10 * time.Second):
		z.t.Fatal("no response in 10s")
	}
	return nil
}

// recvType receives the next response and checks its type.
func (z *ztunnel) recvType(typeURL string) *discovery.DeltaDiscoveryResponse {
	z.t.Helper()
	resp := z.recv()
	if resp.TypeUrl != typeURL {
		z.t.Fatalf("response of type %s, want %s", resp.TypeUrl, typeURL)
	}
	return resp
}

func (z *ztunnel) ack(resp *discovery.DeltaDiscoveryResponse) {
	z.send(&discovery.DeltaDiscoveryRequest{TypeUrl: resp.TypeUrl, ResponseNonce: resp.Nonce})
}

// quiet checks that nothing arrives for a while.
func (z *ztunnel) quiet(d time.Duration) {
	z.t.Helper()
	select {
	case resp := <-z.resps:
		z.t.Fatalf("unexpected response: %v", resp)
	case err := <-z.errs:
		z.t.Fatalf("stream ended: %v", err)
	case <-time.After(d):
	}
}

func names(resp *discovery.DeltaDiscoveryResponse) []string {
	var out []string
	for _, r := range resp.Resources {
		out = append(out, r.Name)
	}
	slices.Sort(out)
	return out
}

func decode(t *testing.T, r *discovery.Resource) *workloadapi.Workload {
	t.Helper()
	if r.Resource.TypeUrl != xds.AddressType {
		t.Fatalf("inner type %s, want %s", r.Resource.TypeUrl, xds.AddressType)
	}
	var addr workloadapi.Address
	if err := proto.Unmarshal(r.Resource.Value, &addr); err != nil {
		t.Fatal(err)
	}
	return addr.GetWorkload()
}

func startAgent(t *testing.T, extra ...cell.Cell) *agenttest.Agent {
	return agenttest.Start(t, manifestsFrom(t, "testdata/cluster.yaml"), extra, "--xds-coalesce=1ms")
}

const newPod = `
apiVersion: v1
kind: Pod
metadata: {name: db, namespace: app, labels: {app: db}}
spec: {nodeName: node-b, serviceAccountName: db}
status: {phase: Running, podIPs: [{ip: %s}]}
`

func TestDeltaStream(t *testing.T) {
	a := startAgent(t)
	z, err := connect(t, a, "tok-a")
	if err != nil {
		t.Fatal(err)
	}

	// Step 1: wildcard subscriptions to both types are answered at once:
	// every enrolled pod, and an empty Authorization set.
	z.subscribe(xds.AddressType, nil, false)
	z.subscribe(xds.AuthorizationType, nil, false)
	addrs := z.recvType(xds.AddressType)
	authz := z.recvType(xds.AuthorizationType)
	if got := names(addrs); !slices.Equal(got, []string{apiUID, webUID}) {
		t.Fatalf("initial snapshot %v, want the enrolled pods api and web", got)
	}
	if len(authz.Resources) != 0 || len(authz.RemovedResources) != 0 {
		t.Fatalf("authorization answer %v, want empty", authz)
	}
	z.ack(addrs)
	z.ack(authz)

	// The workloads carry the fields the agent needs. HBONE only where the
	// redirect is really in place: api's node published it; web is on this
	// node, whose datapath (off in this test) has no redirect for it, so its
	// annotation (stale, say after a restart) does not count.
	for _, r := range addrs.Resources {
		w := decode(t, r)
		switch r.Name {
		case webUID:
			want := &workloadapi.Workload{
				Uid: webUID, Name: "web", Namespace: "app", ServiceAccount: "web", Node: "node-a",
				Addresses:    [][]byte{{10, 0, 1, 10}}, // trust domain and cluster id: the defaults, left out
				WorkloadType: workloadapi.WorkloadType_POD, TunnelProtocol: workloadapi.TunnelProtocol_NONE,
				CanonicalName: "web", CanonicalRevision: "v2", WorkloadName: "web",
				Status: workloadapi.WorkloadStatus_HEALTHY,
			}
			if !proto.Equal(w, want) {
				t.Errorf("web workload\n got %v\nwant %v", w, want)
			}
		case apiUID:
			if w.TunnelProtocol != workloadapi.TunnelProtocol_HBONE || w.Node != "node-b" {
				t.Errorf("api workload: %v, want HBONE on node-b", w)
			}
		}
		if r.Version == "" {
			t.Errorf("%s without a version", r.Name)
		}
	}

	// Step 2: a new pod in an enrolled namespace is exactly one resource.
	a.WriteManifest(t, "db.yaml", strings.ReplaceAll(newPod, "%s", "10.0.2.30"))
	resp := z.recvType(xds.AddressType)
	if got := names(resp); !slices.Equal(got, []string{"Kubernetes//Pod/app/db"}) || len(resp.RemovedResources) != 0 {
		t.Fatalf("add: %v removed %v, want only app/db", got, resp.RemovedResources)
	}
	firstVersion := resp.Resources[0].Version
	z.ack(resp)

	// Step 3: a change of the pod (its address) is that resource again,
	// with a new version.
	a.WriteManifest(t, "db.yaml", strings.ReplaceAll(newPod, "%s", "10.0.2.31"))
	resp = z.recvType(xds.AddressType)
	if got := names(resp); !slices.Equal(got, []string{"Kubernetes//Pod/app/db"}) || resp.Resources[0].Version == firstVersion {
		t.Fatalf("change: %v, want app/db with a new version", resp)
	}
	if w := decode(t, resp.Resources[0]); string(w.Addresses[0]) != string([]byte{10, 0, 2, 31}) {
		t.Fatalf("change: addresses %v", w.Addresses)
	}
	// Step 4: a NACK is recorded and the stream lives on.
	z.send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.AddressType, ResponseNonce: resp.Nonce,
		ErrorDetail: status.New(codes.InvalidArgument, "db: unsupported field").Proto()})
	waitClient(t, a, func(c *xds.Client) bool {
		return c.Nacks == 1 && c.LastNack == resp.Nonce+": db: unsupported field" && c.Pod == "kube-system/ztunnel-a" &&
			c.NodeID == node.Id && c.Subscriptions[xds.AddressType] == "*"
	})

	// Step 5: deleting the pod is exactly its removal.
	if err := os.Remove(filepath.Join(a.Manifests, "db.yaml")); err != nil {
		t.Fatal(err)
	}
	resp = z.recvType(xds.AddressType)
	if len(resp.Resources) != 0 || !slices.Equal(resp.RemovedResources, []string{"Kubernetes//Pod/app/db"}) {
		t.Fatalf("delete: %v, want only the removal of app/db", resp)
	}
	z.ack(resp)
	z.quiet(200 * time.Millisecond)
}

// A client that reconnects tells what it holds: names that no longer exist
// come back removed; resources it holds at the current version are not
// sent again.
func TestReconnectWithInitialVersions(t *testing.T) {
	a := startAgent(t)
	z, err := connect(t, a, "tok-a")
	if err != nil {
		t.Fatal(err)
	}
	z.subscribe(xds.AddressType, nil, false)
	first := z.recvType(xds.AddressType)
	versions := map[string]string{}
	for _, r := range first.Resources {
		versions[r.Name] = r.Version
	}
	z.cancel()

	// Exactly what it was sent: an empty answer, found by digest; web,
	// this node's, is held as it said.
	// reconnectHoldingAll reconnects with versions, which hold the table:
	// an empty answer, the unchanged-reconnects counter at want.
	reconnectHoldingAll := func(want float64) *ztunnel {
		z, err := connect(t, a, "tok-a")
		if err != nil {
			t.Fatal(err)
		}
		z.subscribe(xds.AddressType, versions, false)
		if resp := z.recvType(xds.AddressType); len(resp.Resources) != 0 || len(resp.RemovedResources) != 0 {
			t.Errorf("answer %v to a client that holds everything, want an empty one", resp)
		}
		if got := counterValue(t, a, "mtlsbridge_xds_reconnects_unchanged_total"); got != want {
			t.Errorf("%v reconnects found unchanged, want %v", got, want)
		}
		return z
	}
	z1 := reconnectHoldingAll(1)
	txn := a.DB.ReadTxn()
	var acked []string
	for row := range (statedb.AnyTable{Meta: a.DB.GetTable(txn, xds.AcksTableName)}).All(txn) {
		acked = append(acked, row.(*xds.Ack).UID)
	}
	if !slices.Equal(acked, []string{webUID}) {
		t.Errorf("xds-acks %v, want web (claimed at its version)", acked)
	}
	// A pod added, then changed (its workload replaced): the client that
	// followed holds the table exactly again.
	for _, ip := range []string{"10.0.2.30", "10.0.2.31"} {
		a.WriteManifest(t, "db.yaml", strings.ReplaceAll(newPod, "%s", ip))
		resp := z1.recvType(xds.AddressType)
		for _, r := range resp.Resources {
			versions[r.Name] = r.Version
		}
	}
	z1.cancel()
	z1 = reconnectHoldingAll(2)
	// As many claims, one of them a name that does not exist in place of
	// api: not taken for the same set.
	swapped := maps.Clone(versions)
	delete(swapped, apiUID)
	swapped["Kubernetes//Pod/app/other"] = versions[apiUID]
	z1.cancel()
	z1, err = connect(t, a, "tok-a")
	if err != nil {
		t.Fatal(err)
	}
	z1.subscribe(xds.AddressType, swapped, false)
	if resp := z1.recvType(xds.AddressType); !slices.Equal(names(resp), []string{apiUID}) {
		t.Errorf("resent %v, want api", names(resp))
	}
	z1.cancel()

	held := map[string]string{
		webUID:                     versions[webUID], // current
		apiUID:                     "stale",          // outdated version
		"Kubernetes//Pod/app/gone": "1234",           // no longer exists
	}
	z2, err := connect(t, a, "tok-a")
	if err != nil {
		t.Fatal(err)
	}
	z2.subscribe(xds.AddressType, held, false)
	resp := z2.recvType(xds.AddressType)
	if got := names(resp); !slices.Equal(got, []string{apiUID, "Kubernetes//Pod/app/db"}) {
		t.Errorf("resent %v, want only api and db (web is current)", got)
	}
	if !slices.Equal(resp.RemovedResources, []string{"Kubernetes//Pod/app/gone"}) {
		t.Errorf("removed %v, want the name that no longer exists", resp.RemovedResources)
	}

	// Authorization: held names come back removed too.
	z2.subscribe(xds.AuthorizationType, map[string]string{"app/old-policy": "1"}, false)
	authz := z2.recvType(xds.AuthorizationType)
	if !slices.Equal(authz.RemovedResources, []string{"app/old-policy"}) {
		t.Errorf("authorization removed %v, want app/old-policy", authz.RemovedResources)
	}
}

// On demand (XDS_ON_DEMAND): the client subscribes and unsubscribes "*",
// then asks for "network/ip" names; unknown names are answered as removed.
func TestOnDemand(t *testing.T) {
	a := startAgent(t)
	z, err := connect(t, a, "tok-a")
	if err != nil {
		t.Fatal(err)
	}
	z.subscribe(xds.AddressType, nil, true)
	if resp := z.recvType(xds.AddressType); len(resp.Resources)+len(resp.RemovedResources) != 0 {
		t.Fatalf("on-demand first answer %v, want empty", resp)
	}
	z.send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.AddressType,
		ResourceNamesSubscribe: []string{"/10.0.1.10", "/10.9.9.9", "app/web.app.svc.cluster.local"}})
	resp := z.recvType(xds.AddressType)
	if got := names(resp); !slices.Equal(got, []string{webUID}) || !slices.Equal(resp.Resources[0].Aliases, []string{"/10.0.1.10"}) {
		t.Errorf("on-demand answer %v, want web aliased /10.0.1.10", resp.Resources)
	}
	removed := slices.Sorted(slices.Values(resp.RemovedResources))
	if !slices.Equal(removed, []string{"/10.9.9.9", "app/web.app.svc.cluster.local"}) {
		t.Errorf("removed %v, want the unknown names", removed)
	}
	// Changes of other workloads are not pushed to an on-demand client...
	a.WriteManifest(t, "db.yaml", strings.ReplaceAll(newPod, "%s", "10.9.9.8"))
	z.quiet(300 * time.Millisecond)
	// ...but a workload that takes an address answered as unknown is,
	// under that name: ztunnel would otherwise treat the address as
	// outside the mesh until it looked it up again.
	a.WriteManifest(t, "db.yaml", strings.ReplaceAll(newPod, "%s", "10.9.9.9"))
	resp = z.recvType(xds.AddressType)
	if got := names(resp); !slices.Equal(got, []string{"Kubernetes//Pod/app/db"}) || !slices.Equal(resp.Resources[0].Aliases, []string{"/10.9.9.9"}) {
		t.Errorf("push once db takes the awaited address: %v, want db aliased /10.9.9.9", resp.Resources)
	}
	// Held now: its changes are pushed as any held workload's.
	a.WriteManifest(t, "db.yaml", strings.ReplaceAll(strings.ReplaceAll(newPod, "%s", "10.9.9.9"), "app: db", "app: db2"))
	if got := names(z.recvType(xds.AddressType)); !slices.Equal(got, []string{"Kubernetes//Pod/app/db"}) {
		t.Errorf("db changed: push %v, want db", got)
	}
	// db goes, and another pod takes its address: the name, still
	// subscribed, follows the address again.
	if err := os.Remove(filepath.Join(a.Manifests, "db.yaml")); err != nil {
		t.Fatal(err)
	}
	if resp := z.recvType(xds.AddressType); !slices.Equal(resp.RemovedResources, []string{"Kubernetes//Pod/app/db"}) {
		t.Errorf("db deleted: push %v, want its removal", resp)
	}
	a.WriteManifest(t, "db.yaml", strings.ReplaceAll(strings.ReplaceAll(newPod, "%s", "10.9.9.9"), "name: db,", "name: db2,"))
	resp = z.recvType(xds.AddressType)
	if got := names(resp); !slices.Equal(got, []string{"Kubernetes//Pod/app/db2"}) || !slices.Equal(resp.Resources[0].Aliases, []string{"/10.9.9.9"}) {
		t.Errorf("push once db2 takes the address: %v, want db2 aliased /10.9.9.9", resp.Resources)
	}
	// The pod table may show db before db2's workload goes, or after:
	// either way db follows, in the same push or the next.
	a.WriteManifest(t, "db.yaml", strings.ReplaceAll(newPod, "%s", "10.9.9.9"))
	var sent, gone []string
	for len(sent) == 0 || len(gone) == 0 {
		resp := z.recvType(xds.AddressType)
		sent, gone = append(sent, names(resp)...), append(gone, resp.RemovedResources...)
	}
	if !slices.Equal(sent, []string{"Kubernetes//Pod/app/db"}) || !slices.Equal(gone, []string{"Kubernetes//Pod/app/db2"}) {
		t.Errorf("db back in db2's place: sent %v, removed %v; want db and db2", sent, gone)
	}

	// A name asked again is answered again, though subscribed already:
	// ztunnel asks once per lookup and waits for the answer. db's and
	// web's, held, are sent again.
	z.send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.AddressType, ResourceNamesSubscribe: []string{"/10.9.9.9", "/10.0.1.10"}})
	if got := names(z.recvType(xds.AddressType)); !slices.Equal(got, []string{"Kubernetes//Pod/app/db", webUID}) {
		t.Errorf("answer to names asked again: %v, want db and web", got)
	}

	// Two names for web: dropping one keeps the other's subscription, so
	// web's removal still reaches the client.
	z.send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.AddressType, ResourceNamesSubscribe: []string{webUID}})
	z.recvType(xds.AddressType)
	z.send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.AddressType, ResourceNamesUnsubscribe: []string{"/10.0.1.10"}})
	editManifest(t, a, "cluster.yaml", "name: web,", "name: web2,")
	if resp := z.recvType(xds.AddressType); !slices.Contains(resp.RemovedResources, webUID) {
		t.Errorf("web deleted, push %v, want its removal", resp)
	}
}

// A first request that subscribes a workload by its uid gets it once.
func TestFirstRequestByUID(t *testing.T) {
	a := startAgent(t)
	z, err := connect(t, a, "tok-a")
	if err != nil {
		t.Fatal(err)
	}
	z.send(&discovery.DeltaDiscoveryRequest{Node: node, TypeUrl: xds.AddressType, ResourceNamesSubscribe: []string{webUID}})
	if got := names(z.recvType(xds.AddressType)); !slices.Equal(got, []string{webUID}) {
		t.Errorf("answer %v, want web once", got)
	}
}

// ztunnel on demand reconnects naming what it holds in
// initial_resource_versions only: those stay subscribed, their changes
// are pushed, and what it holds unchanged is not sent again.
func TestOnDemandReconnect(t *testing.T) {
	a := startAgent(t)
	z, err := connect(t, a, "tok-a")
	if err != nil {
		t.Fatal(err)
	}
	z.subscribe(xds.AddressType, nil, true)
	z.recvType(xds.AddressType)
	z.send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.AddressType, ResourceNamesSubscribe: []string{"/10.0.1.10"}})
	held := map[string]string{}
	for _, r := range z.recvType(xds.AddressType).Resources {
		held[r.Name] = r.Version
	}
	z.cancel()

	// Held as it is, a uid of a pod that does not exist yet, and an
	// address no pod has yet.
	held["Kubernetes//Pod/app/db"] = "1"
	held["/10.0.2.31"] = "1"
	z, err = connect(t, a, "tok-a")
	if err != nil {
		t.Fatal(err)
	}
	z.subscribe(xds.AddressType, held, true)
	if resp := z.recvType(xds.AddressType); len(resp.Resources) != 0 ||
		!slices.Equal(slices.Sorted(slices.Values(resp.RemovedResources)), []string{"/10.0.2.31", "Kubernetes//Pod/app/db"}) {
		t.Fatalf("reconnect answer %v, want db and the address removed only", resp)
	}
	// Its row counts the names it holds as its subscriptions.
	waitClient(t, a, func(c *xds.Client) bool { return c.Subscriptions[xds.AddressType] == strconv.Itoa(len(held)) })
	// The names it holds are followed: db once it exists, web's change.
	a.WriteManifest(t, "db.yaml", strings.ReplaceAll(newPod, "%s", "10.0.2.30"))
	if got := names(z.recvType(xds.AddressType)); !slices.Equal(got, []string{"Kubernetes//Pod/app/db"}) {
		t.Errorf("db appeared, push %v, want db", got)
	}
	editManifest(t, a, "cluster.yaml", "serviceAccountName: web}", "serviceAccountName: web-v2}")
	if got := names(z.recvType(xds.AddressType)); !slices.Equal(got, []string{webUID}) {
		t.Errorf("web changed, push %v, want web", got)
	}
	// And the address, once a pod takes it, under its name.
	a.WriteManifest(t, "cache.yaml", strings.ReplaceAll(strings.ReplaceAll(newPod, "%s", "10.0.2.31"), "name: db,", "name: cache,"))
	resp := z.recvType(xds.AddressType)
	if got := names(resp); !slices.Equal(got, []string{"Kubernetes//Pod/app/cache"}) || !slices.Equal(resp.Resources[0].Aliases, []string{"/10.0.2.31"}) {
		t.Errorf("cache took the claimed address, push %v, want cache aliased /10.0.2.31", resp.Resources)
	}
}

// On demand, a pod of this node that the CNI plugin is starting: its
// address resolves before the API shows it.
func TestOnDemandNewSandbox(t *testing.T) {
	var workloads statedb.Table[*workload.Workload]
	a := startAgent(t, cell.Invoke(func(w statedb.Table[*workload.Workload]) { workloads = w }))
	a.WriteManifest(t, "fresh.yaml", `
apiVersion: v1
kind: Pod
metadata: {name: fresh, namespace: app, labels: {cilium.io/redir-type: workload}}
spec: {nodeName: node-a}
status: {phase: Pending}
`)
	// The plugin's question at ADD (the datapath is off here: the answer
	// stays pending, the report is recorded).
	client := http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", client.SocketPath(a.StateDir))
	}}}
	freshUID := "Kubernetes//Pod/app/fresh"
	deadline := time.Now().Add(10 * time.Second)
	for {
		resp, err := client.Post("http://agent"+plugin.PodPathPrefix+"app/fresh", "application/json",
			strings.NewReader(`{"containerID": "c-fresh", "ips": ["10.0.1.77"]}`))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if _, _, ok := workloads.Get(a.DB.ReadTxn(), workload.ByUID(freshUID)); ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no workload for the pod the plugin reported")
		}
		time.Sleep(50 * time.Millisecond)
	}

	z, err := connect(t, a, "tok-a")
	if err != nil {
		t.Fatal(err)
	}
	z.subscribe(xds.AddressType, nil, true)
	z.recvType(xds.AddressType)
	z.send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.AddressType, ResourceNamesSubscribe: []string{"/10.0.1.77"}})
	resp := z.recvType(xds.AddressType)
	if got := names(resp); !slices.Equal(got, []string{freshUID}) {
		t.Fatalf("on-demand answer %v (removed %v), want fresh", got, resp.RemovedResources)
	}
	if w := decode(t, resp.Resources[0]); len(w.GetAddresses()) != 1 {
		t.Errorf("fresh's workload has addresses %v, want the reported one", w.GetAddresses())
	}
}

func TestRefusedCallers(t *testing.T) {
	a := startAgent(t)
	for _, tc := range []struct {
		token string
		code  codes.Code
	}{
		{"", codes.Unauthenticated},
		{"tok-nobody", codes.Unauthenticated},
		{"tok-web", codes.PermissionDenied},
		{"tok-b", codes.PermissionDenied},
	} {
		z, err := connect(t, a, tc.token)
		if err == nil {
			// The refusal may come before the request is sent: ignore
			// the send error, the stream's end tells why.
			z.stream.Send(&discovery.DeltaDiscoveryRequest{Node: node, TypeUrl: xds.AddressType})
			select {
			case err = <-z.errs:
			case resp := <-z.resps:
				t.Fatalf("token %q got a response: %v", tc.token, resp)
			case <-time.After(10 * time.Second):
				t.Fatalf("token %q: no refusal", tc.token)
			}
		}
		if status.Code(err) != tc.code {
			t.Errorf("token %q: %v, want %s", tc.token, err, tc.code)
		}
	}
	// State of the world is not served.
	stream, err := discovery.NewAggregatedDiscoveryServiceClient(a.Dial(t)).StreamAggregatedResources(
		metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer tok-a"))
	if err == nil {
		_, err = stream.Recv()
	}
	if status.Code(err) != codes.Unimplemented {
		t.Errorf("state-of-the-world: %v, want Unimplemented", err)
	}
}

func waitClient(t *testing.T, a *agenttest.Agent, cond func(*xds.Client) bool) {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		txn := a.DB.ReadTxn()
		tbl := statedb.AnyTable{Meta: a.DB.GetTable(txn, xds.ClientsTableName)}
		objs, watch := tbl.AllWatch(txn)
		for obj := range objs {
			if cond(obj.(*xds.Client)) {
				return
			}
		}
		select {
		case <-watch:
		case <-deadline:
			t.Fatal("no xds-clients row as expected")
		}
	}
}

// A client that stops reading cannot hold the server: its stream holds at
// most one queued response, is closed after --xds-send-timeout, and other
// streams are served meanwhile.
func TestStuckClientIsClosed(t *testing.T) {
	manifests := t.TempDir()
	content, err := os.ReadFile("testdata/cluster.yaml")
	if err != nil {
		t.Fatal(err)
	}
	// Enough workloads that the snapshot outgrows HTTP/2 flow control
	// windows of a client that reads nothing.
	var many strings.Builder
	for i := range 3000 {
		fmt.Fprintf(&many, "---\napiVersion: v1\nkind: Pod\nmetadata: {name: filler-%d, namespace: app}\n"+
			"spec: {nodeName: node-b}\nstatus: {phase: Running, podIPs: [{ip: 10.1.%d.%d}]}\n", i, i/250, i%250+1)
	}
	if err := os.WriteFile(filepath.Join(manifests, "cluster.yaml"), append(content, many.String()...), 0o644); err != nil {
		t.Fatal(err)
	}
	a := agenttest.Start(t, manifests, nil, "--xds-send-timeout=500ms", "--xds-max-resources-per-response=10")

	// The stuck client subscribes and never reads.
	stuck, err := connect(t, a, "tok-a")
	if err != nil {
		t.Fatal(err)
	}
	stuck.subscribe(xds.AddressType, nil, false)

	// A healthy client on its own connection gets everything meanwhile.
	healthy, err := connect(t, a, "tok-a")
	if err != nil {
		t.Fatal(err)
	}
	healthy.subscribe(xds.AddressType, nil, false)
	got := 0
	for got < 3002 {
		resp := healthy.recvType(xds.AddressType)
		got += len(resp.Resources)
		healthy.ack(resp)
	}

	// The stuck stream is closed by the server: its row goes.
	waitClient(t, a, func(c *xds.Client) bool { return c.ResourcesSent == 3002 })
	deadline := time.Now().Add(10 * time.Second)
	for {
		rows := 0
		txn := a.DB.ReadTxn()
		for range (statedb.AnyTable{Meta: a.DB.GetTable(txn, xds.ClientsTableName)}).All(txn) {
			rows++
		}
		if rows == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d xds-clients rows, want only the healthy stream's", rows)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if !strings.Contains(a.Logs.String(), "client took no response for 500ms") {
		t.Error("no log line saying why the stuck stream was closed")
	}
}

// A stream holds a bounded number of names (the issue: 4 requests of 1M
// unknown names took 962 MB), and requests for types the server does not
// serve are counted, their warnings rate-limited (10,000 garbage types
// logged 10,000 lines). Other streams are served meanwhile.
func TestStreamBounds(t *testing.T) {
	a := agenttest.Start(t, manifestsFrom(t, "testdata/cluster.yaml"), nil, "--xds-max-names=1000", "--xds-max-streams=2")

	greedy, err := connect(t, a, "tok-a")
	if err != nil {
		t.Fatal(err)
	}
	greedy.subscribe(xds.AddressType, nil, true)
	greedy.recvType(xds.AddressType)
	names := make([]string, 600)
	for i := range names {
		names[i] = fmt.Sprintf("app/nothing-%d", i)
	}
	greedy.send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.AddressType, ResourceNamesSubscribe: names})
	greedy.recvType(xds.AddressType) // all 600 removed: they do not exist
	greedy.send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.AddressType, ResourceNamesSubscribe: names[:500]})
	greedy.send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.AddressType, ResourceNamesSubscribe: append(names[:0:0], strings.Split(strings.Repeat("app/more ", 500), " ")[:500]...)})
	select {
	case err := <-greedy.errs:
		if status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), "--xds-max-names=1000") {
			t.Fatalf("greedy stream closed with %v, want ResourceExhausted naming the bound", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a stream holding more names than --xds-max-names was not closed")
	}

	noisy, err := connect(t, a, "tok-a")
	if err != nil {
		t.Fatal(err)
	}
	for i := range 10_000 {
		noisy.send(&discovery.DeltaDiscoveryRequest{TypeUrl: fmt.Sprintf("type.googleapis.com/garbage.%d", i)})
	}
	// Still served: its first real request is answered after the garbage.
	noisy.subscribe(xds.AddressType, nil, false)
	if resp := noisy.recvType(xds.AddressType); len(resp.Resources) == 0 {
		t.Fatal("no workloads after the garbage")
	}
	if got := counterValue(t, a, "mtlsbridge_xds_unknown_type_requests_total"); got != 10_000 {
		t.Errorf("unknown type requests counted %v, want 10000", got)
	}
	if lines := strings.Count(a.Logs.String(), "xDS request for an unknown type ignored"); lines > 5 {
		t.Errorf("%d warning lines for 10,000 garbage requests: not rate-limited", lines)
	}

	// Streams are bounded too (and with them the names all streams hold):
	// noisy and a second stream are served, a third is refused, and a
	// stream that ends makes room.
	second, err := connect(t, a, "tok-a")
	if err != nil {
		t.Fatal(err)
	}
	second.subscribe(xds.AddressType, nil, false)
	second.recvType(xds.AddressType)
	third, err := connect(t, a, "tok-a")
	if err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-third.errs:
		if status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), "--xds-max-streams") {
			t.Fatalf("third stream closed with %v, want ResourceExhausted naming the bound", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a stream beyond --xds-max-streams was not refused")
	}
	second.cancel()
	for deadline := time.Now().Add(10 * time.Second); ; {
		if time.Now().After(deadline) {
			t.Fatal("no stream served after one of two ended")
		}
		fourth, err := connect(t, a, "tok-a")
		if err != nil {
			t.Fatal(err)
		}
		// Refused, the stream may be closed before the request goes.
		_ = fourth.stream.Send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.AddressType, Node: node})
		select {
		case <-fourth.errs:
			continue // the server has not seen second's end yet
		case <-fourth.resps:
		}
		break
	}
}

// What a stream keeps of a client's words is bounded in length too: a
// name longer than a workload's uid or an address can be closes the
// stream, subscribed or claimed, and a NACK's detail is kept truncated.
func TestStreamNameBounds(t *testing.T) {
	a := agenttest.Start(t, manifestsFrom(t, "testdata/cluster.yaml"), nil)
	long := "app/" + strings.Repeat("x", 4<<10)
	for _, req := range []*discovery.DeltaDiscoveryRequest{
		{TypeUrl: xds.AddressType, Node: node, ResourceNamesSubscribe: []string{"app/web", long}},
		{TypeUrl: xds.AddressType, Node: node, InitialResourceVersions: map[string]string{"app/web": "1", long: "1"}},
	} {
		z, err := connect(t, a, "tok-a")
		if err != nil {
			t.Fatal(err)
		}
		z.send(req)
		select {
		case err := <-z.errs:
			if status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), "bytes, more than") {
				t.Fatalf("stream closed with %v, want ResourceExhausted naming the length", err)
			}
		case resp := <-z.resps:
			t.Fatalf("a name of %d bytes answered: %v", len(long), resp.GetRemovedResources())
		case <-time.After(10 * time.Second):
			t.Fatal("a name of 4 KiB did not close the stream")
		}
	}

	z, err := connect(t, a, "tok-a")
	if err != nil {
		t.Fatal(err)
	}
	z.subscribe(xds.AddressType, nil, true)
	resp := z.recvType(xds.AddressType)
	z.send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.AddressType, ResponseNonce: resp.Nonce,
		ErrorDetail: status.New(codes.InvalidArgument, strings.Repeat("y", 1<<20)).Proto()})
	waitClient(t, a, func(c *xds.Client) bool {
		return c.Nacks == 1 && strings.HasPrefix(c.LastNack, resp.Nonce+": yyy") && len(c.LastNack) <= 1003
	})
	// So are a node id and an acknowledged nonce of any length.
	z, err = connect(t, a, "tok-a")
	if err != nil {
		t.Fatal(err)
	}
	z.send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.AddressType, Node: &core.Node{Id: strings.Repeat("n", 1<<20)}})
	z.recvType(xds.AddressType)
	z.send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.AddressType, ResponseNonce: strings.Repeat("x", 1<<20)})
	waitClient(t, a, func(c *xds.Client) bool {
		return strings.HasPrefix(c.NodeID, "nnn") && len(c.NodeID) <= 1003 &&
			strings.HasPrefix(c.LastAckNonce, "xxx") && len(c.LastAckNonce) <= 103
	})
}

// manifestsFrom is a manifest folder holding file.
func manifestsFrom(t *testing.T, file string) string {
	manifests := t.TempDir()
	content, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(manifests, filepath.Base(file)), content, 0o644); err != nil {
		t.Fatal(err)
	}
	return manifests
}

// The xds-acks rows follow what the client acknowledged: every response
// of an answer is acknowledged only once it is all sent (the stream reads
// no request meanwhile), and a NACKed response leaves this node's
// workloads it carried without a row (the client may hold them or not).
func TestAcksFollowTheClient(t *testing.T) {
	const local = 100 // this node's pods, one response each
	var manifest strings.Builder
	for i := range local {
		fmt.Fprintf(&manifest, "---\napiVersion: v1\nkind: Pod\nmetadata: {name: p-%d, namespace: app}\n"+
			"spec: {nodeName: node-a, serviceAccountName: sa}\nstatus: {phase: Running, podIPs: [{ip: 10.0.3.%d}]}\n", i, i)
	}
	a := agenttest.Start(t, manifestsFrom(t, "testdata/cluster.yaml"), nil, "--xds-coalesce=1ms", "--xds-max-resources-per-response=1")
	a.WriteManifest(t, "local.yaml", manifest.String())
	acks := func() map[string]bool {
		rows := map[string]bool{}
		txn := a.DB.ReadTxn()
		for row := range (statedb.AnyTable{Meta: a.DB.GetTable(txn, xds.AcksTableName)}).All(txn) {
			rows[row.(*xds.Ack).UID] = true
		}
		return rows
	}
	waitAcks := func(want int, cond func(map[string]bool) bool) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
			if rows := acks(); len(rows) == want && cond(rows) {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("xds-acks: %d rows, want %d", len(acks()), want)
			}
		}
	}
	z, err := connect(t, a, "tok-a")
	if err != nil {
		t.Fatal(err)
	}
	// Wait for the derivation to have every pod, then take the whole
	// snapshot before acknowledging any of it.
	waitWorkloads(t, a, local+2) // and web and api
	z.subscribe(xds.AddressType, nil, false)
	var resps []*discovery.DeltaDiscoveryResponse
	for held := 0; held < local+2; {
		resp := z.recvType(xds.AddressType)
		held += len(resp.Resources)
		resps = append(resps, resp)
	}
	for _, resp := range resps {
		z.ack(resp)
	}
	waitAcks(local+1, func(rows map[string]bool) bool { return rows[webUID] }) // and web, api is node-b's

	editManifest(t, a, "cluster.yaml", "serviceAccountName: web}", "serviceAccountName: web-v2}")
	resp := z.recvType(xds.AddressType)
	if got := names(resp); !slices.Equal(got, []string{webUID}) {
		t.Fatalf("web changed, push %v", got)
	}
	z.send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.AddressType, ResponseNonce: resp.Nonce,
		ErrorDetail: status.New(codes.InvalidArgument, "web: rejected").Proto()})
	waitAcks(local, func(rows map[string]bool) bool { return !rows[webUID] })
}

// waitWorkloads waits until the workloads table has n rows.
func waitWorkloads(t *testing.T, a *agenttest.Agent, n int) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		txn := a.DB.ReadTxn()
		if got := a.DB.GetTable(txn, workload.TableName).NumObjects(txn); got == n {
			return
		} else if time.Now().After(deadline) {
			t.Fatalf("%d workloads, want %d", got, n)
		}
	}
}

// A stream is served only while its caller is this node's mTLS agent: a
// change of its pod that keeps it one goes unnoticed, one that ends it (the
// label removed) ends the stream, not only the next one.
func TestStreamEndsWithItsAgent(t *testing.T) {
	a := startAgent(t)
	z, err := connect(t, a, "tok-a")
	if err != nil {
		t.Fatal(err)
	}
	z.subscribe(xds.AddressType, nil, false)
	z.recvType(xds.AddressType)
	const agentPod = "name: ztunnel-a, namespace: kube-system, labels: {cilium.io/redir-type: proxy"
	editManifest(t, a, "cluster.yaml", agentPod+"}", agentPod+", version: v2}")
	z.quiet(300 * time.Millisecond)
	editManifest(t, a, "cluster.yaml", agentPod+", version: v2}", "name: ztunnel-a, namespace: kube-system, labels: {version: v3}")
	select {
	case err := <-z.errs:
		if status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), "is not an mTLS agent") {
			t.Fatalf("stream ended with %v, want PermissionDenied: not an mTLS agent", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the stream of a pod that is no agent any more goes on")
	}
}

// editManifest replaces the first old in one of the agent's manifests.
func editManifest(t *testing.T, a *agenttest.Agent, file, old, new string) {
	t.Helper()
	content, err := os.ReadFile(filepath.Join(a.Manifests, file))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(content), old) {
		t.Fatalf("%s has no %q", file, old)
	}
	a.WriteManifest(t, file, strings.Replace(string(content), old, new, 1))
}

// counterValue reads a counter of the agent's registry.
func counterValue(t *testing.T, a *agenttest.Agent, name string) float64 {
	mfs, err := a.Metrics.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf.GetMetric()[0].GetCounter().GetValue()
		}
	}
	t.Fatalf("no metric %s", name)
	return 0
}

// A client may turn wildcard on and off on a live stream: turned on, it
// receives what it lacks (not what it already holds); turned off, it hears
// only of its names, and of the removal of what it still holds.
func TestWildcardToggled(t *testing.T) {
	a := startAgent(t)
	z, err := connect(t, a, "tok-a")
	if err != nil {
		t.Fatal(err)
	}
	z.subscribe(xds.AddressType, nil, true)
	z.ack(z.recvType(xds.AddressType))
	z.send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.AddressType, ResourceNamesSubscribe: []string{"/10.0.1.10"}})
	webResp := z.recvType(xds.AddressType)
	if !slices.Equal(names(webResp), []string{webUID}) {
		t.Fatalf("on-demand answer %v, want web", names(webResp))
	}
	acked := func() []string {
		txn := a.DB.ReadTxn()
		var uids []string
		for row := range (statedb.AnyTable{Meta: a.DB.GetTable(txn, xds.AcksTableName)}).All(txn) {
			uids = append(uids, row.(*xds.Ack).UID)
		}
		return uids
	}

	// Step 1: wildcard on: api comes, web (held) does not come again.
	// Web, this node's, is not acknowledged before the client says so.
	z.send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.AddressType, ResourceNamesSubscribe: []string{"*"}})
	if resp := z.recvType(xds.AddressType); !slices.Equal(names(resp), []string{apiUID}) {
		t.Fatalf("wildcard answer %v, want api only", names(resp))
	}
	if got := acked(); len(got) != 0 {
		t.Fatalf("xds-acks %v before the client acknowledged anything", got)
	}
	z.ack(webResp)
	deadline := time.Now().Add(5 * time.Second)
	for !slices.Equal(acked(), []string{webUID}) {
		if time.Now().After(deadline) {
			t.Fatalf("xds-acks %v after web's ACK, want web", acked())
		}
		time.Sleep(10 * time.Millisecond)
	}
	a.WriteManifest(t, "db.yaml", strings.ReplaceAll(newPod, "%s", "10.0.2.30"))
	if resp := z.recvType(xds.AddressType); !slices.Equal(names(resp), []string{"Kubernetes//Pod/app/db"}) {
		t.Fatalf("push %v, want db", names(resp))
	}

	// Step 2: wildcard off: db's change is not pushed, its removal is.
	z.send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.AddressType, ResourceNamesUnsubscribe: []string{"*"}})
	// Requests are handled in order: once a name asked after it is
	// answered, wildcard is off.
	z.send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.AddressType, ResourceNamesSubscribe: []string{"/10.9.9.9"}})
	if resp := z.recvType(xds.AddressType); !slices.Equal(resp.RemovedResources, []string{"/10.9.9.9"}) {
		t.Fatalf("answer %v, want /10.9.9.9 removed", resp)
	}
	a.WriteManifest(t, "db.yaml", strings.ReplaceAll(newPod, "%s", "10.0.2.31"))
	z.quiet(300 * time.Millisecond)
	a.WriteManifest(t, "db.yaml", "")
	if resp := z.recvType(xds.AddressType); len(resp.Resources) != 0 || !slices.Equal(resp.RemovedResources, []string{"Kubernetes//Pod/app/db"}) {
		t.Fatalf("push %v, want db removed", resp)
	}
}

// An initial snapshot of several full responses (1000 resources each,
// written into buffers the server reuses once gRPC has their bytes) comes
// whole and intact, twice: every resource is the workload it names. The
// Authorization answer, asked right after as ztunnel does, comes after the
// last of them: ztunnel is ready once it has a response of each type.
func TestLargeSnapshot(t *testing.T) {
	const pods = 2500
	var manifest strings.Builder
	for i := range pods {
		fmt.Fprintf(&manifest, "---\napiVersion: v1\nkind: Pod\nmetadata: {name: p-%d, namespace: app}\n"+
			"spec: {nodeName: node-b, serviceAccountName: sa}\nstatus: {phase: Running, podIPs: [{ip: 10.1.%d.%d}]}\n", i, i/250, i%250)
	}
	a := startAgent(t)
	a.WriteManifest(t, "many.yaml", manifest.String())
	waitWorkloads(t, a, pods+2)
	for range 2 {
		z, err := connect(t, a, "tok-a")
		if err != nil {
			t.Fatal(err)
		}
		z.subscribe(xds.AddressType, nil, false)
		z.subscribe(xds.AuthorizationType, nil, false)
		seen := map[string]bool{}
		for len(seen) < pods+2 {
			resp := z.recv()
			if resp.TypeUrl != xds.AddressType {
				t.Fatalf("%s answered with %d of %d workloads sent", resp.TypeUrl, len(seen), pods+2)
			}
			for _, r := range resp.Resources {
				if w := decode(t, r); w.GetUid() != r.Name || seen[r.Name] {
					t.Fatalf("resource %q holds workload %q (seen before: %v)", r.Name, w.GetUid(), seen[r.Name])
				}
				seen[r.Name] = true
			}
			z.ack(resp)
		}
		z.recvType(xds.AuthorizationType)
	}
}
