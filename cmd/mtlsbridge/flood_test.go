// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	pb "istio.io/api/security/v1alpha1"

	"github.com/mtlsbridge/mtlsbridge/internal/agenttest"
	"github.com/mtlsbridge/mtlsbridge/internal/cnitest"
	"github.com/mtlsbridge/mtlsbridge/internal/syncbuf"
)

// TestUnauthenticatedFloodIsNotRead reproduces the memory
// exhaustion: without a token, 3 TLS connections each send 64 concurrent
// CreateCertificate calls carrying a 15 MB csr (it took the agent from
// 59 MB to 6 GB). The agent refuses them from their headers, never reads
// their bodies, and keeps serving the mTLS agent.
func TestUnauthenticatedFloodIsNotRead(t *testing.T) {
	a := startServingAgent(t)
	before := rss(t, a.pid, "VmRSS")

	// The flood: one 15 MB request, encoded once and sent by every call.
	body, err := proto.Marshal(&pb.IstioCertificateRequest{Csr: strings.Repeat("A", 15<<20)})
	must(t, err)
	codec := sameBytes{body}
	var wg sync.WaitGroup
	var mu sync.Mutex
	codesSeen := map[codes.Code]int{}
	for range 3 {
		flood := a.dial(t)
		for range 64 {
			wg.Go(func() {
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				defer cancel()
				err := flood.Invoke(ctx, pb.IstioCertificateService_CreateCertificate_FullMethodName,
					&pb.IstioCertificateRequest{}, &pb.IstioCertificateResponse{}, grpc.ForceCodecV2(codec))
				mu.Lock()
				codesSeen[status.Code(err)]++
				mu.Unlock()
			})
		}
	}
	wg.Wait()
	if codesSeen[codes.Unauthenticated] != 3*64 {
		t.Errorf("flood answered %v, want 192 Unauthenticated", codesSeen)
	}
	peak := rss(t, a.pid, "VmHWM")
	t.Logf("agent RSS before the flood %d MiB, peak %d MiB", before>>20, peak>>20)
	if grown := peak - before; grown > 64<<20 {
		t.Errorf("the flood grew the agent's RSS by %d MiB (bodies read before refusing)", grown>>20)
	}
	a.stillServes(t)
}

// TestHeaderFloodIsNotHeld: a stranger's connections each send one header
// block of about 9 MiB (a huge authorization value, over CONTINUATION
// frames) and never end it. The agent reads headers whole before it can
// refuse the caller, so it must not take that much: it closes each
// connection (it cannot have waited for the block's end), its memory does
// not grow, and it keeps serving the mTLS agent.
func TestHeaderFloodIsNotHeld(t *testing.T) {
	a := startServingAgent(t)
	before := rss(t, a.pid, "VmRSS")

	var block bytes.Buffer
	enc := hpack.NewEncoder(&block)
	for _, f := range []hpack.HeaderField{
		{Name: ":method", Value: "POST"}, {Name: ":scheme", Value: "https"},
		{Name: ":path", Value: pb.IstioCertificateService_CreateCertificate_FullMethodName},
		{Name: ":authority", Value: a.addr}, {Name: "content-type", Value: "application/grpc"},
		{Name: "authorization", Value: "Bearer " + strings.Repeat("A", 12<<20)},
	} {
		must(t, enc.WriteField(f))
	}
	const conns, fragment = 8, 16 << 10
	frags := slices.Collect(slices.Chunk(block.Bytes(), fragment))
	closed := make([]error, conns)
	var wg sync.WaitGroup
	for i := range conns {
		c := a.dialHTTP2(t)
		wg.Go(func() {
			fr := http2.NewFramer(c, c)
			// The last fragment, which would end the block, is never sent.
			// Writes fail once the agent closed the connection; what the
			// kernel buffered before says nothing. An agent that stops
			// reading without closing fails the check below, not by a hang.
			c.SetWriteDeadline(time.Now().Add(10 * time.Second))
			for j, frag := range frags[:len(frags)-1] {
				var err error
				if j == 0 {
					err = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: frag})
				} else {
					err = fr.WriteContinuation(1, false, frag)
				}
				if err != nil {
					break
				}
			}
			// The block unfinished, an agent that waits for its end
			// never closes the connection.
			c.SetReadDeadline(time.Now().Add(5 * time.Second))
			for {
				f, err := fr.ReadFrame()
				if err != nil {
					closed[i] = err
					return
				}
				if _, ok := f.(*http2.GoAwayFrame); ok {
					return
				}
			}
		})
	}
	wg.Wait()
	for i, err := range closed {
		if errors.Is(err, os.ErrDeadlineExceeded) {
			t.Errorf("connection %d: still open with an unfinished header block of %d KiB", i, block.Len()>>10)
		}
	}
	now := rss(t, a.pid, "VmRSS")
	t.Logf("agent RSS before the flood %d MiB, after %d MiB", before>>20, now>>20)
	if grown := now - before; grown > 32<<20 {
		t.Errorf("the flood grew the agent's RSS by %d MiB (header blocks held)", grown>>20)
	}
	a.stillServes(t)
}

// servingAgent is an agent process serving gRPC on a loopback port, its
// tables ready (a certificate was issued).
type servingAgent struct {
	addr  string
	pid   int
	roots *x509.CertPool // the agent's trust bundle
	conn  *grpc.ClientConn
	token string
}

func startServingAgent(t *testing.T) *servingAgent {
	bin := filepath.Join(cnitest.Binaries(t), "mtlsbridge")
	stateDir, err := os.MkdirTemp("", "mtlsb-flood-")
	must(t, err)
	t.Cleanup(func() { os.RemoveAll(stateDir) })
	must(t, os.WriteFile(filepath.Join(stateDir+"-tokens"), []byte(agenttest.TokenAgentA+"\n"), 0o600))
	t.Cleanup(func() { os.Remove(stateDir + "-tokens") })
	addr := freeAddr(t)

	logs := &syncbuf.Buffer{}
	agent := exec.Command(bin, "agent", "--source=dir:../../testdata/demo", "--state-dir="+stateDir,
		"--node-name=node-a", "--enable-redirect=false", "--grpc-listen="+addr, "--token-file="+stateDir+"-tokens")
	agent.Stdout, agent.Stderr = logs, logs
	must(t, agent.Start())
	t.Cleanup(func() { agent.Process.Kill(); agent.Wait() })
	a := &servingAgent{addr: addr, pid: agent.Process.Pid, roots: trustBundle(t, stateDir)}
	a.conn = a.dial(t)
	a.token, _, _ = strings.Cut(agenttest.TokenAgentA, " ")

	// The mTLS agent is served before the flood (the tables are ready).
	deadline := time.Now().Add(30 * time.Second)
	for {
		if _, err := requestCertificate(t, a.conn, a.token); err == nil {
			return a
		} else if time.Now().After(deadline) {
			t.Fatalf("no certificate before the flood: %v\n%s", err, logs.String())
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func (a *servingAgent) stillServes(t *testing.T) {
	t.Helper()
	if _, err := requestCertificate(t, a.conn, a.token); err != nil {
		t.Errorf("the mTLS agent is not served after the flood: %v", err)
	}
}

// dialHTTP2 opens a TLS connection speaking HTTP/2 to the agent and sends
// the client preface and settings, as any client would.
func (a *servingAgent) dialHTTP2(t *testing.T) *tls.Conn {
	c, err := tls.Dial("tcp", a.addr, &tls.Config{RootCAs: a.roots, NextProtos: []string{"h2"}})
	must(t, err)
	t.Cleanup(func() { c.Close() })
	_, err = c.Write([]byte(http2.ClientPreface))
	must(t, err)
	must(t, http2.NewFramer(c, c).WriteSettings())
	return c
}

// sameBytes is a client codec that sends one encoded message for every
// call, so that the flood costs the test nothing per call.
type sameBytes struct{ b []byte }

func (c sameBytes) Marshal(any) (mem.BufferSlice, error) {
	return mem.BufferSlice{mem.SliceBuffer(c.b)}, nil
}

func (sameBytes) Unmarshal(data mem.BufferSlice, v any) error {
	return proto.Unmarshal(data.Materialize(), v.(proto.Message))
}

func (sameBytes) Name() string { return "proto" }

func requestCertificate(t *testing.T, conn *grpc.ClientConn, token string) (*pb.IstioCertificateResponse, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	must(t, err)
	u, _ := url.Parse("spiffe://cluster.local/ns/shop/sa/frontend")
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{URIs: []*url.URL{u}}, key)
	must(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token)
	return pb.NewIstioCertificateServiceClient(conn).CreateCertificate(ctx, &pb.IstioCertificateRequest{
		Csr: string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der})),
	})
}

// dial opens a gRPC connection of its own to the agent.
func (a *servingAgent) dial(t *testing.T) *grpc.ClientConn {
	conn, err := grpc.NewClient(a.addr, grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{RootCAs: a.roots})))
	must(t, err)
	t.Cleanup(func() { conn.Close() })
	return conn
}

// trustBundle is the bundle the agent writes into its state folder once
// its CA is loaded.
func trustBundle(t *testing.T, stateDir string) *x509.CertPool {
	var bundle []byte
	for deadline := time.Now().Add(30 * time.Second); bundle == nil; {
		bundle, _ = os.ReadFile(filepath.Join(stateDir, "ca", "root-cert.pem"))
		if bundle == nil {
			if time.Now().After(deadline) {
				t.Fatal("the agent wrote no trust bundle")
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(bundle)
	return pool
}

// rss reads a memory figure of /proc/PID/status in bytes: VmRSS now, or
// VmHWM, the peak.
func rss(t *testing.T, pid int, field string) int64 {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	must(t, err)
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), field+":"); ok {
			kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			must(t, err)
			return kb << 10
		}
	}
	t.Fatalf("no %s in /proc/%d/status", field, pid)
	return 0
}

// freeAddr is a loopback address with a port free a moment ago.
func freeAddr(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	must(t, err)
	defer l.Close()
	return l.Addr().String()
}
