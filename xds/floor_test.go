// SPDX-License-Identifier: Apache-2.0

package xds

import (
	"crypto/tls"
	"io"
	"net"
	"testing"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/mtlsbridge/mtlsbridge/reconcilers/workload"
)

// BenchmarkXDSFloor is the physical floor of the initial snapshot of 100k
// workloads, part by part, for comparison with BenchmarkXDSInitialSnapshot:
//
//	encode: marshalling the snapshot's responses (1000 resources each)
//	tls:    writing those bytes through TLS on loopback to a reader
//	decode: unmarshalling them as the client does
//
// Each reports the snapshot's size (MB) and its cost per MB.
func BenchmarkXDSFloor(b *testing.B) {
	const n, per = 100_000, 1000
	var resps []*discovery.DeltaDiscoveryResponse
	for i := 0; i < n; i += per {
		resp := &discovery.DeltaDiscoveryResponse{TypeUrl: AddressType, Nonce: "1"}
		for j := i; j < i+per; j++ {
			w, err := workload.New("Kubernetes", "cluster.local", benchPod(j, 0), true)
			if err != nil {
				b.Fatal(err)
			}
			resp.Resources = append(resp.Resources, &discovery.Resource{
				Name: w.UID, Version: w.VersionString(),
				Resource: &anypb.Any{TypeUrl: AddressType, Value: []byte(w.Resource)},
			})
		}
		resps = append(resps, resp)
	}
	var wire [][]byte
	size := 0
	for _, r := range resps {
		bs, err := proto.Marshal(r)
		if err != nil {
			b.Fatal(err)
		}
		wire = append(wire, bs)
		size += len(bs)
	}
	mb := float64(size) / (1 << 20)
	perMB := func(b *testing.B) {
		b.ReportMetric(mb, "MB")
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/mb/1e3, "us/MB")
	}

	b.Run("encode", func(b *testing.B) {
		for b.Loop() {
			for _, r := range resps {
				if _, err := proto.Marshal(r); err != nil {
					b.Fatal(err)
				}
			}
		}
		perMB(b)
	})
	b.Run("tls", func(b *testing.B) {
		serverTLS, clientTLS := tlsPair(b)
		l, err := tls.Listen("tcp", "127.0.0.1:0", serverTLS)
		if err != nil {
			b.Fatal(err)
		}
		defer l.Close()
		go func() {
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				go func() { io.Copy(io.Discard, c); c.Close() }()
			}
		}()
		clientTLS.ServerName = "127.0.0.1"
		conn, err := tls.Dial("tcp", l.Addr().String(), clientTLS)
		if err != nil {
			b.Fatal(err)
		}
		defer conn.Close()
		var _ net.Conn = conn
		for b.Loop() {
			for _, bs := range wire {
				if _, err := conn.Write(bs); err != nil {
					b.Fatal(err)
				}
			}
		}
		perMB(b)
	})
	b.Run("decode", func(b *testing.B) {
		for b.Loop() {
			for _, bs := range wire {
				var r discovery.DeltaDiscoveryResponse
				if err := proto.Unmarshal(bs, &r); err != nil {
					b.Fatal(err)
				}
			}
		}
		perMB(b)
	})
}
