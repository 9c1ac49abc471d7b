// SPDX-License-Identifier: Apache-2.0

package xds

import (
	"crypto/tls"
	"io"
	"net"
	"slices"
	"testing"
	"time"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
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
// Each reports the snapshot's size (MB) and its cost per MB. And the floor
// of BenchmarkXDSChangeLatency, under its conditions (a push every 2 ms on
// an otherwise idle connection), p50 and p99 over 200 pushes:
//
//	wake/tls:  one 1 KiB TLS write on loopback until the reader has it
//	wake/grpc: a goroutine handed one prebuilt response, sending it on a
//	           delta xDS stream, until the client has it (gRPC, HTTP/2, TLS)
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
				Name: w.UID(), Version: w.VersionString(),
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
		writer, reader := tlsLoopback(b)
		go io.Copy(io.Discard, reader)
		for b.Loop() {
			for _, bs := range wire {
				if _, err := writer.Write(bs); err != nil {
					b.Fatal(err)
				}
			}
		}
		perMB(b)
	})
	b.Run("wake/tls", func(b *testing.B) {
		server, client := tlsLoopback(b)
		msg, buf := make([]byte, 1024), make([]byte, 1024)
		wakeLatency(b, func() {
			if _, err := server.Write(msg); err != nil {
				b.Fatal(err)
			}
			if _, err := io.ReadFull(client, buf); err != nil {
				b.Fatal(err)
			}
		})
	})
	b.Run("wake/grpc", func(b *testing.B) {
		push := make(chan *discovery.DeltaDiscoveryResponse)
		client := serve(b, func(srv *grpc.Server) {
			discovery.RegisterAggregatedDiscoveryServiceServer(srv, &pushOnly{push: push})
		})
		c := open(b, client, &discovery.DeltaDiscoveryRequest{TypeUrl: AddressType})
		defer c.cancel()
		resp := &discovery.DeltaDiscoveryResponse{TypeUrl: AddressType, Nonce: "1", Resources: resps[0].Resources[:1]}
		wakeLatency(b, func() {
			push <- resp
			c.until(b, func(*scanned) bool { return true })
		})
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

// wakeLatency times roundTrip as BenchmarkXDSChangeLatency times a change:
// 200 times per iteration, 2 ms apart.
func wakeLatency(b *testing.B, roundTrip func()) {
	var latencies []time.Duration
	for b.Loop() {
		for range 200 {
			time.Sleep(2 * time.Millisecond)
			start := time.Now()
			roundTrip()
			latencies = append(latencies, time.Since(start))
		}
	}
	slices.Sort(latencies)
	b.ReportMetric(float64(latencies[len(latencies)/2].Microseconds()), "p50-us")
	b.ReportMetric(float64(latencies[len(latencies)*99/100].Microseconds()), "p99-us")
}

// pushOnly is a delta xDS server that sends what it is handed and reads
// (and drops) what the client sends.
type pushOnly struct {
	discovery.UnimplementedAggregatedDiscoveryServiceServer
	push chan *discovery.DeltaDiscoveryResponse
}

func (p *pushOnly) DeltaAggregatedResources(stream discovery.AggregatedDiscoveryService_DeltaAggregatedResourcesServer) error {
	go func() {
		for {
			if _, err := stream.Recv(); err != nil {
				return
			}
		}
	}()
	for {
		select {
		case resp := <-p.push:
			if err := stream.Send(resp); err != nil {
				return err
			}
		case <-stream.Context().Done():
			return nil
		}
	}
}

// tlsLoopback returns both ends of a TLS connection on loopback, closed
// when b ends.
func tlsLoopback(b *testing.B) (server, client net.Conn) {
	serverTLS, clientTLS := tlsPair(b)
	l, err := tls.Listen("tcp", "127.0.0.1:0", serverTLS)
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := l.Accept()
		if err != nil {
			close(accepted)
			return
		}
		// tls.Dial waits for the handshake, which the server does on
		// first use.
		if err := c.(*tls.Conn).Handshake(); err != nil {
			c.Close()
			close(accepted)
			return
		}
		accepted <- c
	}()
	clientTLS.ServerName = "127.0.0.1"
	client, err = tls.Dial("tcp", l.Addr().String(), clientTLS)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { client.Close() })
	server, ok := <-accepted
	if !ok {
		b.Fatal("TLS server handshake failed")
	}
	b.Cleanup(func() { server.Close() })
	return server, client
}
