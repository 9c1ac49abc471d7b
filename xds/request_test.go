// SPDX-License-Identifier: Apache-2.0

package xds

import (
	"fmt"
	"maps"
	"testing"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
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
	got, err := decodeRequest(b, 4)
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
		if _, err := decodeRequest(bad, 4); err == nil {
			t.Errorf("decodeRequest(%x) accepted", bad)
		}
	}
	// An entry's field past its end, a name that is not UTF-8, a varint
	// cut short: refused when the claims are read.
	for _, bad := range [][]byte{{0x2a, 0x02, 0x0a, 0x09}, {0x2a, 0x03, 0x0a, 0x01, 0xa8}, {0x2a, 0x02, 0x08, 0x80}} {
		req, err := decodeRequest(bad, 4)
		if err == nil {
			err = req.initial.read()
		}
		if err == nil {
			t.Errorf("claims of %x accepted", bad)
		}
	}
	// More initial versions than a stream may hold: refused before they
	// are decoded.
	if _, err := decodeRequest(b, 3); status.Code(err) != codes.ResourceExhausted {
		t.Errorf("4 initial versions, at most 3: %v, want ResourceExhausted", err)
	}
}

func BenchmarkDecodeRequest(b *testing.B) {
	versions := map[string]string{}
	for i := range 100_000 {
		versions[fmt.Sprintf("Kubernetes//Pod/ns-%d/pod-%d-0", i%1000, i)] = "9f3c2a1b4d5e6f70"
	}
	raw, _ := proto.Marshal(&discovery.DeltaDiscoveryRequest{TypeUrl: AddressType, InitialResourceVersions: versions})
	b.Run("direct", func(b *testing.B) {
		for b.Loop() {
			decodeRequest(raw, len(versions))
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
		req, err := decodeRequest(b, 100)
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
