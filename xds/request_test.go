// SPDX-License-Identifier: Apache-2.0

package xds

import (
	"errors"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"testing"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/mtlsbridge/mtlsbridge/reconcilers/workload"
)

// decodeRequest reads what the generated decoder reads, with the initial
// versions parsed apart.
func TestDecodeRequest(t *testing.T) {
	want := &discovery.DeltaDiscoveryRequest{
		TypeUrl: AddressType, ResponseNonce: "3",
		ResourceNamesSubscribe: []string{"*", "/10.0.0.1"}, ResourceNamesUnsubscribe: []string{"x"},
		InitialResourceVersions: map[string]string{"a": "1f", "b": "stale", "c": "", "": "2"},
	}
	b, err := proto.Marshal(want)
	if err != nil {
		t.Fatal(err)
	}
	got, err := decodeRequest(oneBuffer(b), 4)
	if err != nil {
		t.Fatal(err)
	}
	if err := got.initial.read(); err != nil {
		t.Fatal(err)
	}
	if !maps.Equal(got.initial.held(), map[string]uint64{"a": 0x1f, "b": 0, "c": 0, "": 2}) {
		t.Errorf("initial versions %v", got.initial.held())
	}
	want.InitialResourceVersions = nil
	if !proto.Equal(want, got.DeltaDiscoveryRequest) {
		t.Errorf("request %v, want %v", got.DeltaDiscoveryRequest, want)
	}
	// Truncated, not a tag: refused at once.
	for _, bad := range [][]byte{{0x2a, 0x05, 0x0a}, {0xff}} {
		if _, err := decodeRequest(oneBuffer(bad), 4); err == nil {
			t.Errorf("decodeRequest(%x) accepted", bad)
		}
	}
	// An entry's field past its end, a name that is not UTF-8, a varint
	// cut short: refused when the claims are read.
	for _, bad := range [][]byte{{0x2a, 0x02, 0x0a, 0x09}, {0x2a, 0x03, 0x0a, 0x01, 0xa8}, {0x2a, 0x02, 0x08, 0x80}} {
		req, err := decodeRequest(oneBuffer(bad), 4)
		if err == nil {
			err = req.initial.read()
		}
		if err == nil {
			t.Errorf("claims of %x accepted", bad)
		}
	}
	// More initial versions than a stream may hold: refused before they
	// are decoded.
	if _, err := decodeRequest(oneBuffer(b), 3); status.Code(err) != codes.ResourceExhausted {
		t.Errorf("4 initial versions, at most 3: %v, want ResourceExhausted", err)
	}
}

// A request reads the same however gRPC's buffers cut it: through fields
// and their headers, varints and groups. Every field but a group is read
// where it lies, or joined.
func TestDecodeRequestAcrossBuffers(t *testing.T) {
	b, err := proto.Marshal(&discovery.DeltaDiscoveryRequest{
		TypeUrl: AddressType, ResponseNonce: "3", ResourceNamesSubscribe: []string{"*"},
		InitialResourceVersions: map[string]string{"Kubernetes//Pod/ns/a": "1f", "Kubernetes//Pod/ns/b": "2"},
	})
	if err != nil {
		t.Fatal(err)
	}
	// Unknown fields of every wire type, which the message keeps.
	b = protowire.AppendTag(b, 100, protowire.VarintType)
	b = protowire.AppendVarint(b, 1<<63)
	b = protowire.AppendTag(b, 101, protowire.Fixed32Type)
	b = protowire.AppendFixed32(b, 7)
	b = protowire.AppendTag(b, 103, protowire.BytesType)
	b = protowire.AppendBytes(b, make([]byte, 300))
	withGroup := protowire.AppendTag(slices.Clone(b), 102, protowire.StartGroupType)
	withGroup = protowire.AppendTag(withGroup, 1, protowire.Fixed64Type)
	withGroup = protowire.AppendFixed64(withGroup, 9)
	withGroup = protowire.AppendTag(withGroup, 102, protowire.EndGroupType)
	cutShort := append(slices.Clone(withGroup), withGroup[:6]...) // the first field again, cut short

	walk := func(data mem.BufferSlice) ([]field, error) {
		var got []field
		err := fields(data, func(f field) error {
			f.raw = slices.Clone(f.raw)
			got = append(got, f)
			return nil
		})
		return got, err
	}
	inPlace, err := walk(oneBuffer(b))
	if err != nil {
		t.Fatal(err)
	}
	whole, err := decodeRequest(oneBuffer(withGroup), 4)
	if err == nil {
		err = whole.initial.read()
	}
	if err != nil {
		t.Fatal(err)
	}
	for size := 1; size <= len(withGroup); size++ {
		// An empty buffer at the end, which gRPC does not make, reads the same.
		if got, err := walk(append(pieces(b, size), mem.SliceBuffer(nil))); err != nil || !reflect.DeepEqual(got, inPlace) {
			t.Fatalf("fields in pieces of %d: %v, %+v\nin one: %+v", size, err, got, inPlace)
		}
		if _, err := decodeRequest(pieces(cutShort, size), 4); !errors.Is(err, errMalformedRequest) {
			t.Fatalf("cut short, in pieces of %d: %v, want %v", size, err, errMalformedRequest)
		}
		got, err := decodeRequest(pieces(withGroup, size), 4)
		if err == nil {
			err = got.initial.read()
		}
		if err != nil {
			t.Fatalf("in pieces of %d: %v", size, err)
		}
		if got.initial.digest != whole.initial.digest || !maps.Equal(got.initial.held(), whole.initial.held()) {
			t.Fatalf("in pieces of %d: claims %v %+v, whole %v %+v", size, got.initial.held(), got.initial.digest, whole.initial.held(), whole.initial.digest)
		}
		if !proto.Equal(got.DeltaDiscoveryRequest, whole.DeltaDiscoveryRequest) {
			t.Fatalf("in pieces of %d: %v, whole %v", size, got.DeltaDiscoveryRequest, whole.DeltaDiscoveryRequest)
		}
	}
}

// The claims keep gRPC's buffers with a reference of their own: freed by
// gRPC after decoding, the buffers are not reused under them.
func TestClaimsKeepTheirBuffers(t *testing.T) {
	b, err := proto.Marshal(&discovery.DeltaDiscoveryRequest{TypeUrl: AddressType, InitialResourceVersions: map[string]string{"a": "1f", "b": "2"}})
	if err != nil {
		t.Fatal(err)
	}
	pool := &clearingPool{}
	var data mem.BufferSlice
	pooled := 1 // a size gRPC pools
	for mem.IsBelowBufferPoolingThreshold(pooled) {
		pooled *= 2
	}
	for _, piece := range pieces(b, 5) {
		buf := append(make([]byte, 0, pooled), piece.ReadOnlyData()...)
		data = append(data, mem.NewBuffer(&buf, pool))
	}
	req, err := decodeRequest(data, 4)
	if err != nil {
		t.Fatal(err)
	}
	data.Free() // as gRPC does once the message is decoded
	if pool.reused > 0 {
		t.Fatalf("%d buffers reused while the claims hold them", pool.reused)
	}
	if err := req.initial.read(); err != nil {
		t.Fatal(err)
	}
	if !maps.Equal(req.initial.held(), map[string]uint64{"a": 0x1f, "b": 2}) {
		t.Errorf("claims %v", req.initial.held())
	}
}

// clearingPool clears what it gets back, as a reuse would overwrite it.
type clearingPool struct{ reused int }

func (p *clearingPool) Get(n int) *[]byte { b := make([]byte, n); return &b }

func (p *clearingPool) Put(b *[]byte) {
	clear(*b)
	p.reused++
}

// pieces cuts b into buffers of size bytes (the last one shorter).
func pieces(b []byte, size int) mem.BufferSlice {
	var data mem.BufferSlice
	for piece := range slices.Chunk(b, size) {
		data = append(data, mem.SliceBuffer(piece))
	}
	return data
}

func BenchmarkDecodeRequest(b *testing.B) {
	versions := map[string]string{}
	for i := range 100_000 {
		versions[fmt.Sprintf("Kubernetes//Pod/ns-%d/pod-%d-0", i%1000, i)] = "9f3c2a1b4d5e6f70"
	}
	raw, _ := proto.Marshal(&discovery.DeltaDiscoveryRequest{TypeUrl: AddressType, InitialResourceVersions: versions})
	b.Run("direct", func(b *testing.B) {
		received := pieces(raw, 16<<10) // as gRPC receives it
		for b.Loop() {
			decodeRequest(received, len(versions))
		}
	})
	b.Run("generated", func(b *testing.B) {
		for b.Loop() {
			var r discovery.DeltaDiscoveryRequest
			proto.Unmarshal(raw, &r)
		}
	})
}

// A request claiming workloads at their versions, as a client writes it,
// has their digest; one claim off and it has not.
func TestRequestDigest(t *testing.T) {
	var table workload.Digest
	claimed := map[string]string{}
	for i := range 50 {
		w, err := workload.New("Kubernetes", "cluster.local", benchPod(i, 0), true)
		if err != nil {
			t.Fatal(err)
		}
		table.Add(w)
		claimed[w.UID] = w.VersionString()
	}
	digest := func() workload.Digest {
		b, err := proto.Marshal(&discovery.DeltaDiscoveryRequest{TypeUrl: AddressType, InitialResourceVersions: claimed})
		if err != nil {
			t.Fatal(err)
		}
		req, err := decodeRequest(oneBuffer(b), 100)
		if err != nil {
			t.Fatal(err)
		}
		return req.initial.digest
	}
	if got := digest(); got != table {
		t.Fatalf("digest of the claims %+v, of the table %+v", got, table)
	}
	for uid, version := range claimed {
		claimed[uid] = version + "0"
		break
	}
	if got := digest(); got == table {
		t.Fatalf("a changed version kept the table's digest %+v", got)
	}
}

// held lists the claims by name.
func (c *claims) held() map[string]uint64 {
	held := make(map[string]uint64, len(c.names))
	for i, name := range c.names {
		held[name] = c.versions[i]
	}
	return held
}
