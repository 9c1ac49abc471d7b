// SPDX-License-Identifier: Apache-2.0

package xds

import (
	"bytes"
	"strconv"
	"testing"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/mtlsbridge/mtlsbridge/reconcilers/workload"
)

// The hand-written resources are byte for byte what the generated code
// marshals, and read back as the same response.
func TestResponseWireForm(t *testing.T) {
	var out []outgoing
	var want []*discovery.Resource
	for i := range 3 {
		w, err := workload.New("Kubernetes", "cluster.local", benchPod(i, 0), i%2 == 0)
		if err != nil {
			t.Fatal(err)
		}
		alias := ""
		if i == 1 {
			alias = "/10.0.0.1"
		}
		out = append(out, outgoing{w: w, alias: alias})
		r := &discovery.Resource{Name: w.UID(), Version: w.VersionString(), Resource: &anypb.Any{TypeUrl: AddressType, Value: []byte(w.Resource)}}
		if alias != "" {
			r.Aliases = []string{alias}
		}
		want = append(want, r)
	}

	var direct []byte
	for _, r := range want {
		b, err := proto.MarshalOptions{Deterministic: true}.Marshal(&discovery.DeltaDiscoveryResponse{Resources: []*discovery.Resource{r}})
		if err != nil {
			t.Fatal(err)
		}
		direct = append(direct, b...)
	}
	if got := appendResources(nil, AddressType, out); !bytes.Equal(got, direct) {
		t.Fatalf("wire form differs:\n got %x\nwant %x", got, direct)
	}

	var got discovery.DeltaDiscoveryResponse
	if err := proto.Unmarshal(newResponse(newResponseBuffers(), AddressType, "7", out, []string{"gone"}).bytes(), &got); err != nil {
		t.Fatal(err)
	}
	wantResp := &discovery.DeltaDiscoveryResponse{TypeUrl: AddressType, Nonce: "7", RemovedResources: []string{"gone"}, Resources: want}
	if !proto.Equal(&got, wantResp) {
		t.Fatalf("read back %v, want %v", &got, wantResp)
	}
}

func TestHexLen(t *testing.T) {
	for _, v := range []uint64{0, 1, 0xf, 0x10, 0xfff, 0x1000, 1<<63 - 1, 1<<64 - 1} {
		if got, want := hexLen(v), len(strconv.FormatUint(v, 16)); got != want {
			t.Errorf("hexLen(%#x) = %d, want %d", v, got, want)
		}
	}
}
