// SPDX-License-Identifier: Apache-2.0

package e2e_test

import (
	"bufio"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Ports of the benchmark servers in every pod.
const (
	sinkPort   = 9000 // reads everything, answers the byte count at EOF
	pingPort   = 9001 // answers each 1 KiB with 1 KiB
	acceptPort = 9002 // writes one byte and closes
	tlsPort    = 9443 // the sink over TLS 1.3
	chunk      = 1 << 20
	message    = 1 << 10
	idleConns  = 200
)

// BenchmarkMTLS measures, side by side on the testbed, what the proxies
// cost: enrolled -> enrolled across nodes (two proxies, mTLS), the same
// kind of pods not enrolled (direct TCP), and one TLS 1.3 connection
// between the two namespaces of the pods not enrolled (crypto/tls, the
// same library and key type as the proxies'):
//
//   - throughput of one TCP stream (MB/s);
//   - 1 KiB request/response latency on an open connection (p50, p99);
//   - new connections per second, four clients at a time (connect, read one
//     byte, close);
//   - memory per idle proxied connection (live heap and stacks of both
//     proxies).
//
// Needs root (skips otherwise).
func BenchmarkMTLS(b *testing.B) {
	bd := newBed(b, newFolderCluster(b))
	na, nb := bd.nodes[0], bd.nodes[1]
	a1, b1 := na.addPod("a1", "app", true, false), nb.addPod("b1", "app", true, false)
	aplain, bplain := na.addPod("aplain", "app", false, false), nb.addPod("bplain", "app", false, false)
	bd.knows(na, a1, b1, true)
	bd.knows(nb, b1, a1, true)
	for _, p := range []*bedPod{b1, bplain} {
		serveBench(b, p)
	}
	tlsConfig := serveTLS(b, bplain)
	paths := []struct {
		name     string
		from, to *bedPod
		port     uint16
		tls      bool
	}{
		{"mtls", a1, b1, sinkPort, false},
		{"plain", aplain, bplain, sinkPort, false},
		{"tls", aplain, bplain, tlsPort, true},
	}
	dial := func(b *testing.B, from, to *bedPod, port uint16, useTLS bool) net.Conn {
		var c net.Conn
		must(b, from.ns.Do(func() (err error) {
			c, err = net.DialTimeout("tcp", netip.AddrPortFrom(to.ip4, port).String(), requestTimeout)
			return err
		}))
		if useTLS {
			tc := tls.Client(c, tlsConfig)
			must(b, tc.Handshake())
			c = tc
		}
		return c
	}

	b.Run("throughput", func(b *testing.B) {
		for _, p := range paths {
			b.Run(p.name, func(b *testing.B) {
				c := dial(b, p.from, p.to, p.port, p.tls)
				defer c.Close()
				buf := make([]byte, chunk)
				b.SetBytes(chunk)
				for b.Loop() {
					if _, err := c.Write(buf); err != nil {
						b.Fatal(err)
					}
				}
				// Everything written must have arrived: the sink answers
				// its count once it read to the end.
				closeWrite(c)
				c.SetReadDeadline(time.Now().Add(time.Minute))
				line, err := bufio.NewReader(c).ReadString('\n')
				if err != nil {
					b.Fatal(err)
				}
				if n, _ := strconv.Atoi(strings.TrimSpace(line)); n != b.N*chunk {
					b.Fatalf("sink read %d bytes, want %d", n, b.N*chunk)
				}
			})
		}
	})

	b.Run("latency", func(b *testing.B) {
		for _, p := range paths {
			if p.tls {
				continue // the TLS server is a sink only
			}
			b.Run(p.name, func(b *testing.B) {
				c := dial(b, p.from, p.to, pingPort, false)
				defer c.Close()
				req, resp := make([]byte, message), make([]byte, message)
				var times []time.Duration
				for b.Loop() {
					start := time.Now()
					if _, err := c.Write(req); err != nil {
						b.Fatal(err)
					}
					if _, err := io.ReadFull(c, resp); err != nil {
						b.Fatal(err)
					}
					times = append(times, time.Since(start))
				}
				slices.Sort(times)
				b.ReportMetric(float64(times[len(times)/2].Nanoseconds())/1e3, "p50-µs")
				b.ReportMetric(float64(times[len(times)*99/100].Nanoseconds())/1e3, "p99-µs")
			})
		}
	})

	b.Run("connections", func(b *testing.B) {
		for _, p := range paths {
			if p.tls {
				continue
			}
			// Four clients at a time: what the proxies sustain, not one
			// client's round trips.
			b.Run(p.name, func(b *testing.B) {
				b.SetParallelism(2) // x GOMAXPROCS (2 here)
				b.RunParallel(func(pb *testing.PB) {
					one := make([]byte, 1)
					for pb.Next() {
						var c net.Conn
						err := p.from.ns.Do(func() (err error) {
							c, err = net.DialTimeout("tcp", netip.AddrPortFrom(p.to.ip4, acceptPort).String(), requestTimeout)
							return err
						})
						if err != nil {
							b.Error(err)
							return
						}
						c.SetReadDeadline(time.Now().Add(requestTimeout))
						if _, err := io.ReadFull(c, one); err != nil {
							b.Error(err)
							c.Close()
							return
						}
						c.Close()
					}
				})
				b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "conn/s")
			})
		}
	})

	// Live memory (heap and stacks after a garbage collection, from the
	// proxies' Go metrics) held per idle tunnel, both proxies together.
	b.Run("idle-memory", func(b *testing.B) {
		for b.Loop() {
			before := liveMemory(b, na) + liveMemory(b, nb)
			var conns []net.Conn
			for range idleConns {
				c := dial(b, a1, b1, pingPort, false)
				// One exchange: the tunnel is up at both ends.
				c.Write(make([]byte, message))
				c.SetReadDeadline(time.Now().Add(requestTimeout))
				if _, err := io.ReadFull(c, make([]byte, message)); err != nil {
					b.Fatal(err)
				}
				conns = append(conns, c)
			}
			after := liveMemory(b, na) + liveMemory(b, nb)
			b.ReportMetric(float64(after-before)/idleConns/1024, "KiB/conn")
			for _, c := range conns {
				c.Close()
			}
			b.StopTimer()
			time.Sleep(500 * time.Millisecond) // let the proxies close theirs
			b.StartTimer()
		}
	})
}

// liveMemory is the node proxy's heap in use and goroutine stacks right
// after a garbage collection (which its admin port's heap profile runs).
func liveMemory(b *testing.B, n *bedNode) float64 {
	b.Helper()
	var c net.Conn
	must(b, n.proxyPod.ns.Do(func() (err error) {
		c, err = net.DialTimeout("tcp", "127.0.0.1:15000", requestTimeout)
		return err
	}))
	c.SetDeadline(time.Now().Add(requestTimeout))
	fmt.Fprintf(c, "GET /debug/pprof/heap?gc=1 HTTP/1.0\r\nHost: localhost\r\n\r\n")
	io.Copy(io.Discard, c)
	c.Close()
	return n.metric("go_memstats_heap_inuse_bytes") + n.metric("go_memstats_stack_inuse_bytes")
}

func closeWrite(c net.Conn) {
	switch c := c.(type) {
	case *net.TCPConn:
		c.CloseWrite()
	case *tls.Conn:
		c.CloseWrite()
	}
}

// serveBench starts the sink, ping and accept servers in the pod.
func serveBench(t testing.TB, p *bedPod) {
	serve(t, p, sinkPort, func(c net.Conn) { sink(c) })
	serve(t, p, pingPort, func(c net.Conn) {
		buf := make([]byte, message)
		for {
			if _, err := io.ReadFull(c, buf); err != nil {
				return
			}
			if _, err := c.Write(buf); err != nil {
				return
			}
		}
	})
	serve(t, p, acceptPort, func(c net.Conn) { c.Write([]byte{1}) })
}

// sink reads until EOF and answers the count.
func sink(c net.Conn) {
	n, _ := io.Copy(io.Discard, c)
	fmt.Fprintf(c, "%d\n", n)
}

// serveTLS runs a TLS 1.3 sink in the pod with a fresh ECDSA P-256
// certificate, and returns a client configuration that trusts it.
func serveTLS(t testing.TB, p *bedPod) *tls.Config {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	must(t, err)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), NotBefore: time.Now().Add(-time.Minute), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{p.ip4.AsSlice()}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	must(t, err)
	cert, err := x509.ParseCertificate(der)
	must(t, err)
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	server := &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}}}
	var l net.Listener
	must(t, p.ns.Do(func() (err error) {
		l, err = tls.Listen("tcp", netip.AddrPortFrom(p.ip4, tlsPort).String(), server)
		return err
	}))
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() { defer c.Close(); sink(c) }()
		}
	}()
	return &tls.Config{MinVersion: tls.VersionTLS13, RootCAs: pool, ServerName: p.ip4.String()}
}
