// SPDX-License-Identifier: Apache-2.0

package e2e_test

import (
	"bufio"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"encoding/pem"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
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
	relayPort  = 9444 // the reference relay's TLS side
	chunk      = 1 << 20
	message    = 1 << 10
	idleConns  = 200
)

// BenchmarkMTLS measures, side by side on the testbed, what the proxies
// cost: enrolled -> enrolled across nodes (mtls: two proxies), the same
// kind of pods not enrolled (plain: direct TCP), one TLS 1.3 connection
// between the two namespaces of the pods not enrolled (tls: crypto/tls, the
// same library and key type as the proxies'), those pods through the
// reference relay (see serveRelay: what a Go agent on this path costs at
// the least) run in the nodes' namespaces (relay) and in the proxies' pods
// (relay-in-pods, the proxies' place), and enrolled -> not enrolled
// (plain-via-proxy: the source's proxy relays plain TCP):
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
	// No capture of the underlay while measuring: it copies every frame
	// into this process, a cost the product's path does not have.
	bd.underlay.Close()
	na, nb := bd.nodes[0], bd.nodes[1]
	a1, b1 := na.addPod("a1", "app", true, false), nb.addPod("b1", "app", true, false)
	aplain, bplain := na.addPod("aplain", "app", false, false), nb.addPod("bplain", "app", false, false)
	bd.knows(na, a1, b1, true)
	bd.knows(nb, b1, a1, true)
	for _, p := range []*bedPod{b1, bplain} {
		serveBench(b, p)
	}
	tlsConfig := serveTLS(b, bplain)
	serveRelay(b, nodeHost(na), nodeHost(nb), bplain)
	serveRelay(b, proxyPodHost(na), proxyPodHost(nb), bplain)
	paths := []struct {
		name string
		from *bedPod
		to   netip.Addr
		port uint16
		tls  bool
	}{
		{"mtls", a1, b1.ip4, sinkPort, false},
		{"plain", aplain, bplain.ip4, sinkPort, false},
		{"tls", aplain, bplain.ip4, tlsPort, true},
		{"relay", aplain, na.ns.Addr4, sinkPort, false},
		{"relay-in-pods", aplain, na.proxyPod.ip4, sinkPort, false},
		{"plain-via-proxy", a1, bplain.ip4, sinkPort, false},
	}
	dial := func(b *testing.B, from *bedPod, to netip.Addr, port uint16, useTLS bool) net.Conn {
		var c net.Conn
		must(b, from.ns.Do(func() (err error) {
			c, err = net.DialTimeout("tcp", netip.AddrPortFrom(to, port).String(), requestTimeout)
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
			if p.tls || strings.HasPrefix(p.name, "relay") {
				continue // none listens on the accept port
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
							c, err = net.DialTimeout("tcp", netip.AddrPortFrom(p.to, acceptPort).String(), requestTimeout)
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
	// proxies' Go metrics) held per idle tunnel, both proxies together, and
	// the part of it that is proxy A's (the HBONE client's).
	b.Run("idle-memory", func(b *testing.B) {
		for b.Loop() {
			beforeA, beforeB := liveMemory(b, na), liveMemory(b, nb)
			var conns []net.Conn
			for range idleConns {
				c := dial(b, a1, b1.ip4, pingPort, false)
				// One exchange: the tunnel is up at both ends.
				c.Write(make([]byte, message))
				c.SetReadDeadline(time.Now().Add(requestTimeout))
				if _, err := io.ReadFull(c, make([]byte, message)); err != nil {
					b.Fatal(err)
				}
				conns = append(conns, c)
			}
			afterA, afterB := liveMemory(b, na), liveMemory(b, nb)
			b.ReportMetric((afterA+afterB-beforeA-beforeB)/idleConns/1024, "KiB/conn")
			b.ReportMetric((afterA-beforeA)/idleConns/1024, "KiB-client/conn")
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
// after garbage collections (which its admin port's heap profile runs).
// Two: a sync.Pool keeps what it holds through one collection, and the
// buffers that earlier connections left in pools must not count as the
// baseline.
func liveMemory(b *testing.B, n *bedNode) float64 {
	b.Helper()
	for range 2 {
		if code, _, err := getFrom(n.proxyPod.ns, n.adminURL("/debug/pprof/heap?gc=1")); err != nil || code != http.StatusOK {
			b.Fatalf("%s's proxy heap profile (the collection): %d %v", n.name, code, err)
		}
	}
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

// serveTLS runs a TLS 1.3 sink in the pod, and returns a client
// configuration that trusts it.
func serveTLS(t testing.TB, p *bedPod) *tls.Config {
	pemData := selfSigned(t, p.ip4)
	server, err := serverTLS(pemData)
	must(t, err)
	var l net.Listener
	must(t, p.ns.Do(func() (err error) {
		l, err = tls.Listen("tcp", netip.AddrPortFrom(p.ip4, tlsPort).String(), server)
		return err
	}))
	t.Cleanup(func() { l.Close() })
	go acceptEach(l, sink)
	return clientTLS(pemData, p.ip4)
}

// selfSigned returns a fresh ECDSA P-256 certificate for ip and its key,
// in PEM.
func selfSigned(t testing.TB, ip netip.Addr) []byte {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	must(t, err)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), NotBefore: time.Now().Add(-time.Minute), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{ip.AsSlice()}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	must(t, err)
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	must(t, err)
	return append(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})...)
}

// serverTLS and clientTLS are the TLS 1.3 configurations of a certificate
// and key in PEM, and of a client that trusts that certificate at ip.
func serverTLS(pemData []byte) (*tls.Config, error) {
	cert, err := tls.X509KeyPair(pemData, pemData)
	return &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{cert}}, err
}

func clientTLS(pemData []byte, ip netip.Addr) *tls.Config {
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(pemData)
	return &tls.Config{MinVersion: tls.VersionTLS13, RootCAs: pool, ServerName: ip.String()}
}

// The reference relay (serveRelay) is this test binary run again, in a
// node's namespace, with relayEnv set to its role: "entry" takes plain TCP
// on the addresses of relayEnv_LISTEN and relays it over TLS to
// relayEnv_TO; "exit" takes that TLS on relayEnv_LISTEN and relays it as
// plain TCP to the port the entry asked for at the address relayEnv_TO.
// relayEnv_PEM is the exit's certificate and key, which the entry trusts.
const relayEnv = "MTLSBRIDGE_E2E_RELAY"

func TestMain(m *testing.M) {
	if role := os.Getenv(relayEnv); role != "" {
		if err := runRelay(role, os.Getenv(relayEnv+"_LISTEN"), os.Getenv(relayEnv+"_TO"), os.Getenv(relayEnv+"_PEM")); err != nil {
			fmt.Fprintln(os.Stderr, "relay:", err)
			os.Exit(1)
		}
		return
	}
	os.Exit(m.Run())
}

// serveRelay runs the simplest relay a Go mTLS agent could be, as two
// processes like the proxies: one in the namespace from takes plain TCP on
// its address at the sink and ping ports, and relays each connection over
// its own TLS 1.3 connection to the one in to, which relays it as plain
// TCP to the same port of dst. The same three TCP connections, one
// encryption and one process per node as the proxies' path, without
// capture, HTTP/2, identities, record batching or metrics: what the
// proxies' figures compare with.
func serveRelay(t testing.TB, from, to relayHost, dst *bedPod) {
	pemData := selfSigned(t, to.addr)
	pemFile := filepath.Join(t.TempDir(), "relay.pem")
	must(t, os.WriteFile(pemFile, pemData, 0o600))
	exit := netip.AddrPortFrom(to.addr, relayPort)
	startRelay(t, to.netns, "exit", exit.String(), dst.ip4.String(), pemFile)
	startRelay(t, from.netns, "entry", netip.AddrPortFrom(from.addr, sinkPort).String()+","+
		netip.AddrPortFrom(from.addr, pingPort).String(), exit.String(), pemFile)
}

// relayHost is where one of a relay's processes runs: a node's namespace,
// or the proxy pod's (where the CFP puts the agent, one veth further).
type relayHost struct {
	netns string
	addr  netip.Addr
}

func nodeHost(n *bedNode) relayHost     { return relayHost{n.ns.Name, n.ns.Addr4} }
func proxyPodHost(n *bedNode) relayHost { return relayHost{n.proxyPod.ns.Name, n.proxyPod.ip4} }

// startRelay starts a relay process in the namespace netns and waits until
// it listens; it is killed at the end of the test.
func startRelay(t testing.TB, netns, role, listen, to, pemFile string) {
	exe, err := os.Executable()
	must(t, err)
	cmd := exec.Command("nsenter", "--net=/run/netns/"+netns, "--", exe)
	// One thread, as the proxies take on this 2-core testbed, and the
	// runtime's monitor kept awake, as the proxies keep it
	// (cmd/mtlsbridge-proxy/sysmon.go).
	cmd.Env = append(os.Environ(), "GOMAXPROCS=1", "GODEBUG="+sysmonAwake,
		relayEnv+"="+role, relayEnv+"_LISTEN="+listen, relayEnv+"_TO="+to, relayEnv+"_PEM="+pemFile)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	must(t, err)
	must(t, cmd.Start())
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	ready := make(chan error, 1)
	go func() {
		line, err := bufio.NewReader(out).ReadString('\n')
		if err == nil && line != "ready\n" {
			err = fmt.Errorf("said %q", line)
		}
		ready <- err
	}()
	select {
	case err := <-ready:
		if err != nil {
			t.Fatalf("%s relay: %v", role, err)
		}
	case <-time.After(requestTimeout):
		t.Fatalf("%s relay not listening after %s", role, requestTimeout)
	}
}

// runRelay is a relay process's life: it listens, says "ready" and relays
// until killed.
func runRelay(role, listen, to, pemFile string) error {
	pemData, err := os.ReadFile(pemFile)
	if err != nil {
		return err
	}
	switch role {
	case "exit":
		dst, err := netip.ParseAddr(to)
		if err != nil {
			return err
		}
		server, err := serverTLS(pemData)
		if err != nil {
			return err
		}
		l, err := tls.Listen("tcp", listen, server)
		if err != nil {
			return err
		}
		fmt.Println("ready")
		acceptEach(l, func(c net.Conn) {
			// The first two bytes name the port to reach.
			var port [2]byte
			if _, err := io.ReadFull(c, port[:]); err != nil {
				return
			}
			up, err := net.DialTimeout("tcp", netip.AddrPortFrom(dst, binary.BigEndian.Uint16(port[:])).String(), requestTimeout)
			if err == nil {
				pipe(c, up)
			}
		})
		return nil
	case "entry":
		next, err := netip.ParseAddrPort(to)
		if err != nil {
			return err
		}
		client := clientTLS(pemData, next.Addr())
		for _, addr := range strings.Split(listen, ",") {
			l, err := net.Listen("tcp", addr)
			if err != nil {
				return err
			}
			port := l.Addr().(*net.TCPAddr).AddrPort().Port()
			go acceptEach(l, func(c net.Conn) {
				up, err := net.DialTimeout("tcp", next.String(), requestTimeout)
				if err != nil {
					return
				}
				tc := tls.Client(up, client)
				if _, err := tc.Write(binary.BigEndian.AppendUint16(nil, port)); err != nil {
					tc.Close()
					return
				}
				pipe(c, tc)
			})
		}
		fmt.Println("ready")
		select {}
	}
	return fmt.Errorf("unknown role %q", role)
}

// pipe copies both ways, each end passed on as a half-close, with the
// proxies' large buffer, until both directions ended.
func pipe(a, b net.Conn) {
	defer a.Close()
	defer b.Close()
	oneWay := func(to, from net.Conn) {
		// Through the buffer: io.Copy would pick 32 KiB or splice instead.
		io.CopyBuffer(struct{ io.Writer }{to}, struct{ io.Reader }{from}, make([]byte, 256<<10))
		closeWrite(to)
	}
	done := make(chan struct{})
	go func() { oneWay(b, a); close(done) }()
	oneWay(a, b)
	<-done
}
