// SPDX-License-Identifier: Apache-2.0

package proxy

import (
	"io"
	"log/slog"
	"net/netip"
	"strings"
	"testing"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"istio.io/istio/pkg/workloadapi"
	"istio.io/istio/pkg/workloadapi/security"
)

// TestApplyRejectsPerResource: a response with a Workload whose address
// is 5 bytes, one of another inner type and a good one: the bad ones are
// named in the NACK, the good one is applied and its version held; the
// bad ones' earlier versions stay in effect. Removals apply.
func TestApplyRejectsPerResource(t *testing.T) {
	x := NewXDS(Config{}, NewState("node-a"), NewMetrics(prometheus.NewRegistry()), slog.New(slog.NewTextHandler(io.Discard, nil)))
	good := workload("good", "node-a", []byte{10, 0, 0, 1})
	if err := x.apply(response(AddressType, good, workload("bad", "node-a", []byte{10, 0, 0, 2}))); err != nil {
		t.Fatal(err)
	}
	badUpdate := workload("bad", "node-a", []byte{10, 0, 0, 2, 9})
	badUpdate.Version = "v-bad-2"
	err := x.apply(response(AddressType,
		badUpdate,
		&discovery.Resource{Name: "alien", Version: "1", Resource: &anypb.Any{TypeUrl: AuthorizationType}},
		workload("new", "node-b", []byte{10, 0, 0, 3})))
	if err == nil || !strings.Contains(err.Error(), "bad:") || !strings.Contains(err.Error(), "alien:") || strings.Contains(err.Error(), "new:") {
		t.Fatalf("NACK detail %v, want bad and alien named, not new", err)
	}
	if x.state.ByIP(netip.MustParseAddr("10.0.0.3")) == nil {
		t.Error("the good resource of the rejected response was not applied")
	}
	if w := x.state.ByIP(netip.MustParseAddr("10.0.0.2")); w == nil || w.UID != "bad" {
		t.Error("the rejected update replaced the last good version")
	}
	if x.versions[AddressType]["bad"] != "v-bad" || x.versions[AddressType]["new"] != "v-new" {
		t.Errorf("versions held %v: want bad's last good version and new's", x.versions[AddressType])
	}
	if _, ok := x.versions[AddressType]["alien"]; ok {
		t.Error("a rejected resource's version is held")
	}

	// Authorization with an address of 3 bytes: rejected.
	bad := &security.Authorization{Name: "p", Namespace: "app", Groups: []*security.Group{{Rules: []*security.Rules{{
		Matches: []*security.Match{{SourceIps: []*security.Address{{Address: []byte{1, 2, 3}, Length: 8}}}},
	}}}}}
	b, _ := proto.Marshal(bad)
	if err := x.apply(&discovery.DeltaDiscoveryResponse{TypeUrl: AuthorizationType, Resources: []*discovery.Resource{
		{Name: "app/p", Version: "1", Resource: &anypb.Any{TypeUrl: AuthorizationType, Value: b}},
	}}); err == nil {
		t.Error("an Authorization with a 3-byte address was accepted")
	}

	// Removal.
	if err := x.apply(&discovery.DeltaDiscoveryResponse{TypeUrl: AddressType, RemovedResources: []string{"good", "unknown"}}); err != nil {
		t.Fatal(err)
	}
	if x.state.ByIP(netip.MustParseAddr("10.0.0.1")) != nil || x.state.ByUID("good") != nil {
		t.Error("removed workload still indexed")
	}
	if _, ok := x.versions[AddressType]["good"]; ok {
		t.Error("removed workload's version still held")
	}
}

// TestReplacedAddress: a pod replaced by another with its address (the
// old one terminating, still sent) keeps the newcomer indexed when the old
// one's removal comes after, whichever of the two was updated last. An
// address left to no workload would send the newcomer's traffic in plain
// TCP.
func TestReplacedAddress(t *testing.T) {
	addr := netip.MustParseAddr("10.0.0.1")
	old, _ := workloadFrom(&workloadapi.Workload{Uid: "old", Namespace: "app", Addresses: [][]byte{addr.AsSlice()}})
	newer, _ := workloadFrom(&workloadapi.Workload{Uid: "new", Namespace: "app", Addresses: [][]byte{addr.AsSlice()}})
	for _, tc := range []struct {
		name string
		puts []*Workload
	}{
		{"the newcomer updated last", []*Workload{old, newer}},
		{"the old one updated last", []*Workload{old, newer, old}},
	} {
		s := NewState("node-a")
		for _, w := range tc.puts {
			s.putWorkload(w.UID, w)
		}
		if w := s.ByIP(addr); w != tc.puts[len(tc.puts)-1] {
			t.Errorf("%s: address held by %v, want the latest put", tc.name, w)
		}
		s.deleteWorkload("old")
		if w := s.ByIP(addr); w == nil || w.UID != "new" {
			t.Errorf("%s, then the old one removed: address held by %v, want new", tc.name, w)
		}
		s.deleteWorkload("new")
		if w := s.ByIP(addr); w != nil {
			t.Errorf("%s, then both removed: address held by %v", tc.name, w)
		}
	}
}

func workload(uid, node string, addr []byte) *discovery.Resource {
	w := &workloadapi.Address{Type: &workloadapi.Address_Workload{Workload: &workloadapi.Workload{
		Uid: uid, Name: uid, Namespace: "app", Node: node, Addresses: [][]byte{addr},
	}}}
	b, _ := proto.Marshal(w)
	return &discovery.Resource{Name: uid, Version: "v-" + uid, Resource: &anypb.Any{TypeUrl: AddressType, Value: b}}
}

func response(typeURL string, rs ...*discovery.Resource) *discovery.DeltaDiscoveryResponse {
	return &discovery.DeltaDiscoveryResponse{TypeUrl: typeURL, Nonce: "n", Resources: rs}
}
