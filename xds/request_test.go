// SPDX-License-Identifier: Apache-2.0

package xds

import (
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"reflect"
	"slices"
	"strconv"
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
// and their headers, varints and groups. Every field but a group longer
// than a header is read where it lies, or joined; such a group, across
// buffers, from the message made whole.
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
	b = protowire.AppendTag(b, 104, protowire.StartGroupType)
	b = protowire.AppendTag(b, 1, protowire.Fixed64Type)
	b = protowire.AppendFixed64(b, 9)
	b = protowire.AppendTag(b, 104, protowire.EndGroupType)
	withLongGroup := protowire.AppendTag(slices.Clone(b), 102, protowire.StartGroupType)
	withLongGroup = protowire.AppendTag(withLongGroup, 1, protowire.BytesType)
	withLongGroup = protowire.AppendString(withLongGroup, "longer than a field's header")
	withLongGroup = protowire.AppendTag(withLongGroup, 102, protowire.EndGroupType)
	// Cut short: the first field again, a varint, a group.
	var cutShort [][]byte
	for _, end := range [][]byte{b[:6], {0xa0, 0x06, 0x80}, {0xa3, 0x06, 0x09, 1, 2}} {
		cutShort = append(cutShort, append(slices.Clone(b), end...))
	}

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
	whole, err := decodeRequest(oneBuffer(withLongGroup), 4)
	if err == nil {
		err = whole.initial.read()
	}
	if err != nil {
		t.Fatal(err)
	}
	check := func(cut string, split func([]byte) mem.BufferSlice) {
		// An empty buffer at the end, which gRPC does not make, reads the same.
		if got, err := walk(append(split(b), mem.SliceBuffer(nil))); err != nil || !reflect.DeepEqual(got, inPlace) {
			t.Fatalf("fields %s: %v, %+v\nin one: %+v", cut, err, got, inPlace)
		}
		for _, short := range cutShort {
			if _, err := decodeRequest(split(short), 4); !errors.Is(err, errMalformedRequest) {
				t.Fatalf("cut short %x, %s: %v, want %v", short[len(b):], cut, err, errMalformedRequest)
			}
		}
		got, err := decodeRequest(split(withLongGroup), 4)
		if err == nil {
			err = got.initial.read()
		}
		if err != nil {
			t.Fatalf("%s: %v", cut, err)
		}
		if got.initial.digest != whole.initial.digest || !maps.Equal(got.initial.held(), whole.initial.held()) {
			t.Fatalf("%s: claims %v %+v, whole %v %+v", cut, got.initial.held(), got.initial.digest, whole.initial.held(), whole.initial.digest)
		}
		if !proto.Equal(got.DeltaDiscoveryRequest, whole.DeltaDiscoveryRequest) {
			t.Fatalf("%s: %v, whole %v", cut, got.DeltaDiscoveryRequest, whole.DeltaDiscoveryRequest)
		}
	}
	for size := 1; size <= len(withLongGroup); size++ {
		check(fmt.Sprintf("in pieces of %d", size), func(b []byte) mem.BufferSlice { return pieces(b, size) })
	}
	random := rand.New(rand.NewPCG(1, 2))
	for range 500 {
		cuts := []int{random.IntN(len(b)), random.IntN(len(b)), random.IntN(len(b))}
		slices.Sort(cuts)
		check(fmt.Sprintf("cut at %v", cuts), func(b []byte) mem.BufferSlice {
			var data mem.BufferSlice
			from := 0
			for _, to := range append(cuts, len(b)) {
				data = append(data, mem.SliceBuffer(b[from:to]))
				from = to
			}
			return data
		})
	}
}

// The claims keep what gRPC received after gRPC frees it: its buffers, by
// a reference of their own, when they hold little more than the request;
// a copy when they hold far more (small frames in large buffers).
func TestClaimsKeepTheirRequest(t *testing.T) {
	claimed := map[string]string{}
	want := map[string]uint64{}
	for i := range 1000 {
		claimed[fuzzUID(i)] = strconv.FormatUint(uint64(i), 16)
		want[fuzzUID(i)] = uint64(i)
	}
	b, err := proto.Marshal(&discovery.DeltaDiscoveryRequest{TypeUrl: AddressType, InitialResourceVersions: claimed})
	if err != nil {
		t.Fatal(err)
	}
	pooled := 1 // the smallest buffer gRPC pools
	for mem.IsBelowBufferPoolingThreshold(pooled) {
		pooled *= 2
	}
	for _, tc := range []struct {
		name            string
		frame, capacity int
		kept            bool
	}{
		{"frames filling their buffers", pooled, pooled, true},
		{"small frames in large buffers", 5, pooled, false},
	} {
		pool := &clearingPool{}
		var data mem.BufferSlice
		for _, frame := range pieces(b, tc.frame) {
			buf := append(make([]byte, 0, max(tc.capacity, len(frame.ReadOnlyData()))), frame.ReadOnlyData()...)
			data = append(data, mem.NewBuffer(&buf, pool))
		}
		req, err := decodeRequest(data, len(claimed))
		if err != nil {
			t.Fatal(err)
		}
		data.Free() // as gRPC does once the message is decoded
		if kept := pool.reused == 0; kept != tc.kept {
			t.Errorf("%s: %d buffers reused, kept %v, want %v", tc.name, pool.reused, kept, tc.kept)
		}
		if err := req.initial.read(); err != nil {
			t.Fatal(err)
		}
		if !maps.Equal(req.initial.held(), want) {
			t.Errorf("%s: claims %v", tc.name, req.initial.held())
		}
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
		claimed[w.UID()] = w.VersionString()
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
