// SPDX-License-Identifier: Apache-2.0

package xds

import (
	"context"
	"encoding/binary"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/cilium/statedb"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/mtlsbridge/mtlsbridge/grpcserver"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/workload"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// Operations of a FuzzDeltaRequests script: each is one byte (modulo
// numOps), a request is followed by its length (uvarint) and bytes. The
// rest of a request's byte (divided by numOps), when not 0, is the size of
// the buffers gRPC receives it in.
const (
	opRequest = iota // the client sends a request (any bytes)
	opChange         // the next byte names a workload that gets new content
	opDelete         // the next byte names a workload that goes
	opPush           // the stream pushes what changed
	numOps
)

// fuzzWorkloads is how many pods the table starts with.
const fuzzWorkloads = 6

// FuzzDeltaRequests runs scripts of delta xDS requests (arbitrary bytes:
// subscriptions, unsubscriptions, initial versions, ACKs and NACKs, in any
// order, well-formed or not) interleaved with workload changes, against
// the real stream logic. Nothing may panic; a request the stream refuses
// ends it with a gRPC status (InvalidArgument, ResourceExhausted); what it
// holds stays within --xds-max-names; and a client that has been wildcard
// from its first Address request on holds, after every push, exactly the
// table. Seeds: testdata/fuzz/FuzzDeltaRequests and below. Long runs:
// make fuzz.
func FuzzDeltaRequests(f *testing.F) {
	reqIn := func(pieceSize byte, r *discovery.DeltaDiscoveryRequest) []byte {
		b, err := proto.Marshal(r)
		if err != nil {
			f.Fatal(err)
		}
		return append(binary.AppendUvarint([]byte{opRequest + numOps*pieceSize}, uint64(len(b))), b...)
	}
	req := func(r *discovery.DeltaDiscoveryRequest) []byte { return reqIn(0, r) }
	script := func(parts ...[]byte) []byte { return slices.Concat(parts...) }
	wildcard := req(&discovery.DeltaDiscoveryRequest{TypeUrl: AddressType})
	f.Add(script(wildcard, []byte{opChange, 1, opDelete, 2, opPush}, req(&discovery.DeltaDiscoveryRequest{TypeUrl: AddressType, ResponseNonce: "1"})))
	f.Add(script(req(&discovery.DeltaDiscoveryRequest{TypeUrl: AddressType, InitialResourceVersions: map[string]string{
		fuzzUID(0): "0", fuzzUID(1): "zz", "Kubernetes//Pod/ns/gone": "1"}}), []byte{opChange, 0, opPush}))
	f.Add(script(req(&discovery.DeltaDiscoveryRequest{TypeUrl: AddressType, ResourceNamesSubscribe: []string{"*"}, ResourceNamesUnsubscribe: []string{"*"}}),
		req(&discovery.DeltaDiscoveryRequest{TypeUrl: AddressType, ResourceNamesSubscribe: []string{"/10.0.0.1", "ns/x.svc", fuzzUID(3)}}),
		[]byte{opDelete, 0, opPush},
		req(&discovery.DeltaDiscoveryRequest{TypeUrl: AddressType, ResourceNamesSubscribe: []string{"*"}}),
		[]byte{opChange, 3, opPush},
		req(&discovery.DeltaDiscoveryRequest{TypeUrl: AddressType, ResourceNamesUnsubscribe: []string{"*", "/10.0.0.1"}})))
	f.Add(script(req(&discovery.DeltaDiscoveryRequest{TypeUrl: AuthorizationType, InitialResourceVersions: map[string]string{"a": "1"}}),
		req(&discovery.DeltaDiscoveryRequest{TypeUrl: "type.googleapis.com/other"}),
		req(&discovery.DeltaDiscoveryRequest{TypeUrl: AddressType, ResponseNonce: "7", ErrorDetail: status.New(codes.InvalidArgument, "no").Proto()})))
	f.Add([]byte{opRequest, 3, 0x2a, 0x05, 0x0a})
	for _, pieceSize := range []byte{1, 7} {
		f.Add(script(reqIn(pieceSize, &discovery.DeltaDiscoveryRequest{TypeUrl: AddressType, InitialResourceVersions: map[string]string{
			fuzzUID(0): "0", fuzzUID(1): "zz", fuzzUID(2): "1"}}), []byte{opDelete, 1, opPush}))
	}

	f.Fuzz(func(t *testing.T, script []byte) {
		fz := newFuzzStream(t)
		for len(script) > 0 {
			op, arg := script[0]%numOps, int(script[0]/numOps)
			script = script[1:]
			switch op {
			case opRequest:
				n, m := binary.Uvarint(script)
				if m <= 0 || n > uint64(len(script)-m) {
					return
				}
				raw := script[m : m+int(n)]
				script = script[m+int(n):]
				if !fz.request(raw, arg) {
					return
				}
			case opChange, opDelete:
				if len(script) == 0 {
					return
				}
				fz.write(int(script[0])%(fuzzWorkloads+2), op == opDelete)
				script = script[1:]
			case opPush:
				fz.push()
			}
		}
	})
}

func fuzzUID(i int) string { return workload.UID("Kubernetes", "ns", fmt.Sprintf("pod-%d", i)) }

// fuzzStream is a stream whose responses a model client applies.
type fuzzStream struct {
	t         *testing.T
	db        *statedb.DB
	workloads statedb.RWTable[*workload.Workload]
	pods      statedb.RWTable[*tables.Pod]
	st        *stream
	gen       int

	// The client: what it holds of Addresses, and whether it has been
	// wildcard since its first Address request.
	view           map[string]string
	subscribed     bool
	alwaysWildcard bool
}

func newFuzzStream(t *testing.T) *fuzzStream {
	db := statedb.New()
	wl, err := workload.NewTable(db)
	must(t, err)
	pods, err := tables.NewPodsTable(db, tables.LocalNode{NodeName: "node-0"})
	must(t, err)
	fz := &fuzzStream{t: t, db: db, workloads: wl, pods: pods, view: map[string]string{}}
	for i := range fuzzWorkloads {
		fz.write(i, false)
	}
	s := newTestServer(t, db, wl, pods, "node-0",
		Config{XDSCoalesce: time.Millisecond, XDSSendTimeout: time.Second, XDSMaxResourcesPerResponse: 2, XDSMaxNames: 16})
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	fz.st = s.newStream(ctx, nil, grpcserver.Caller{Namespace: "kube-system", Pod: "ztunnel"})
	// Room for every response of a script: the model client reads them
	// after each step.
	fz.st.sendq = make(chan wireResponse, 1<<12)
	fz.st.sendErr = make(chan error, 1)
	t.Cleanup(fz.st.forget)
	return fz
}

// write gives pod i new content (its pod too), or deletes its workload.
func (fz *fuzzStream) write(i int, remove bool) {
	fz.gen++
	pod := &tables.Pod{
		Namespace: "ns", Name: fmt.Sprintf("pod-%d", i), NodeName: fmt.Sprintf("node-%d", i%2), ServiceAccount: "sa",
		Labels: tables.NewLabels(map[string]string{"version": strconv.Itoa(fz.gen)}),
		IPs:    []netip.Addr{netip.AddrFrom4([4]byte{10, 0, 0, byte(i)})},
	}
	w, err := workload.New("Kubernetes", "cluster.local", pod, i%3 == 0)
	must(fz.t, err)
	wtxn := fz.db.WriteTxn(fz.workloads, fz.pods)
	if remove {
		fz.workloads.Delete(wtxn, w)
		fz.pods.Delete(wtxn, pod)
	} else {
		fz.workloads.Insert(wtxn, w)
		fz.pods.Insert(wtxn, pod)
	}
	wtxn.Commit()
}

// request hands the stream one request, received in one buffer or, when
// pieceSize is not 0, in buffers of that many bytes; false when the stream
// ends.
func (fz *fuzzStream) request(raw []byte, pieceSize int) bool {
	received := oneBuffer(raw)
	if pieceSize > 0 {
		received = pieces(raw, pieceSize)
	}
	req, err := decodeRequest(received, fz.st.srv.Config.XDSMaxNames)
	malformedClaims := fz.sameAsGenerated(raw, req, err)
	if err != nil {
		return false // the stream ends with InvalidArgument or ResourceExhausted
	}
	if req.GetTypeUrl() == AddressType && !malformedClaims {
		fz.model(req)
	}
	err = fz.st.handle(req)
	fz.st.flush()
	if err != nil {
		// Claims are read (and refused) on the first request of a type;
		// a later request's are not looked at.
		if c := status.Code(err); c != codes.ResourceExhausted && (c != codes.InvalidArgument || !malformedClaims) {
			fz.t.Fatalf("request refused with %v, want ResourceExhausted, or InvalidArgument for malformed claims", err)
		}
		return false
	}
	fz.receive()
	fz.check()
	return true
}

// sameAsGenerated checks decodeRequest, and the claims read from its
// request, against the generated decoder: both accept or refuse raw, and
// read the same message. It tells whether the request was refused only
// for its claims.
func (fz *fuzzStream) sameAsGenerated(raw []byte, req request, err error) (malformedClaims bool) {
	var generated discovery.DeltaDiscoveryRequest
	genErr := proto.Unmarshal(raw, &generated)
	if err == nil {
		// The stream reads the claims when it needs them; here always.
		err = req.initial.read()
		malformedClaims = err != nil
	}
	if status.Code(err) == codes.ResourceExhausted && genErr == nil && len(generated.InitialResourceVersions) > 0 {
		return
	}
	if (err == nil) != (genErr == nil) {
		fz.t.Fatalf("decodeRequest: %v, the generated decoder: %v", err, genErr)
	}
	if err != nil {
		return
	}
	if len(req.initial.held()) != len(generated.InitialResourceVersions) {
		fz.t.Fatalf("initial versions %v, the generated decoder's %v", req.initial.held(), generated.InitialResourceVersions)
	}
	for name, v := range generated.InitialResourceVersions {
		if got, ok := req.initial.version(name); !ok || got != parseVersion(v) {
			fz.t.Fatalf("initial version of %q: %x (%v), the generated decoder's %q", name, got, ok, v)
		}
	}
	generated.InitialResourceVersions = nil
	if !proto.Equal(&generated, req.DeltaDiscoveryRequest) {
		fz.t.Fatalf("request %v, the generated decoder's %v", req.DeltaDiscoveryRequest, &generated)
	}
	return false
}

// model follows what the client itself knows of its Address subscription.
func (fz *fuzzStream) model(req request) {
	req.initial.read() // well-formed: sameAsGenerated read them
	if !fz.subscribed {
		fz.subscribed = true
		wildcard := len(req.GetResourceNamesSubscribe()) == 0 && len(req.GetResourceNamesUnsubscribe()) == 0
		for name, v := range req.initial.held() {
			fz.view[name] = strconv.FormatUint(v, 16)
		}
		if slices.Contains(req.GetResourceNamesSubscribe(), "*") {
			wildcard = true
		}
		fz.alwaysWildcard = wildcard
	}
	if slices.Contains(req.GetResourceNamesUnsubscribe(), "*") {
		fz.alwaysWildcard = false
	}
}

func (fz *fuzzStream) push() {
	if fz.st.changes == nil {
		return
	}
	if _, err := fz.st.pushChanges(); err != nil {
		fz.t.Fatal(err)
	}
	fz.st.flush()
	fz.receive()
	fz.check()
}

// receive applies the responses sent so far to the model client.
func (fz *fuzzStream) receive() {
	for {
		select {
		case resp := <-fz.st.sendq:
			var got discovery.DeltaDiscoveryResponse
			must(fz.t, proto.Unmarshal(resp.bytes(), &got))
			if got.TypeUrl != AddressType {
				continue
			}
			for _, r := range got.Resources {
				fz.view[r.Name] = r.Version
			}
			for _, name := range got.RemovedResources {
				delete(fz.view, name)
			}
		default:
			return
		}
	}
}

func (fz *fuzzStream) check() {
	for _, ts := range fz.st.types {
		if len(ts.names) > fz.st.srv.Config.XDSMaxNames {
			fz.t.Fatalf("the stream holds %d names, more than %d", len(ts.names), fz.st.srv.Config.XDSMaxNames)
		}
	}
	if !fz.alwaysWildcard || fz.st.changes == nil {
		return
	}
	// The stream may not have pushed the latest changes yet: compare
	// with its view, which it has sent.
	want := map[string]string{}
	for w := range fz.workloads.All(fz.st.view) {
		want[w.UID()] = w.VersionString()
	}
	if !maps.Equal(fz.view, want) {
		fz.t.Fatalf("a wildcard client holds\n%v\nthe stream's view is\n%v", fz.view, want)
	}
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
