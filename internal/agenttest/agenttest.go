// SPDX-License-Identifier: Apache-2.0

// Package agenttest runs a whole agent in a test: manifest-folder source,
// its own state folder, the gRPC listener on a free loopback port.
package agenttest

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/pflag"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/mtlsbridge/mtlsbridge/agent"
	"github.com/mtlsbridge/mtlsbridge/api/client"
	"github.com/mtlsbridge/mtlsbridge/grpcserver"
	"github.com/mtlsbridge/mtlsbridge/identity"
	"github.com/mtlsbridge/mtlsbridge/internal/manifesttest"
	"github.com/mtlsbridge/mtlsbridge/internal/syncbuf"
)

// Agent is a running agent on node-a.
type Agent struct {
	DB        *statedb.DB
	Metrics   *prometheus.Registry
	StateDir  string
	Manifests string
	GRPCAddr  string
	// Logs holds everything the agent logged.
	Logs *syncbuf.Buffer
}

// Tokens of the token file: this node's agent, the other node's agent and
// a workload (see testdata of the tests that use them).
const (
	TokenAgentA = "tok-a kube-system/ztunnel-a"
	TokenAgentB = "tok-b kube-system/ztunnel-b"
	TokenWeb    = "tok-web app/web"
)

// Start runs an agent reading manifests from the folder (which the test may
// change), with a token file of the Token* lines, plus extra cells (e.g. a
// cell.Invoke capturing tables) and flags. It waits until every table is
// initialized and the local API listens.
func Start(t testing.TB, manifests string, extra []cell.Cell, flags ...string) *Agent {
	t.Helper()
	stateDir, err := os.MkdirTemp("", "mtlsbridge-") // short: UNIX socket paths
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(stateDir) })
	tokens := filepath.Join(stateDir, "tokens")
	if err := os.WriteFile(tokens, []byte(TokenAgentA+"\n"+TokenAgentB+"\n"+TokenWeb+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}

	a := &Agent{StateDir: stateDir, Manifests: manifests, Logs: &syncbuf.Buffer{}}
	var server *grpcserver.Server
	cells := append([]cell.Cell{agent.Infrastructure, agent.Cell,
		cell.Invoke(func(db *statedb.DB, s *grpcserver.Server, reg *prometheus.Registry) {
			a.DB, server, a.Metrics = db, s, reg
		})}, extra...)
	h := hive.New(cells...)
	fs := pflag.NewFlagSet("", pflag.ContinueOnError)
	h.RegisterFlags(fs)
	// No BPF: these tests run as root in CI and must not touch the node's
	// real bpffs; the datapath has tests of its own in network namespaces.
	args := append([]string{"--source=dir:" + manifests, "--state-dir=" + stateDir, "--node-name=node-a",
		"--grpc-listen=127.0.0.1:0", "--token-file=" + tokens, "--enable-redirect=false"}, flags...)
	if err := fs.Parse(args); err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(a.Logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := h.Start(log, ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		h.Stop(log, context.Background())
		if t.Failed() {
			t.Logf("agent log:\n%s", a.Logs.String())
		}
	})

	for {
		txn := a.DB.ReadTxn()
		pending := false
		var watches []<-chan struct{}
		for _, tbl := range a.DB.GetTables(txn) {
			if ok, w := tbl.Initialized(txn); !ok {
				pending = true
				watches = append(watches, w)
			}
		}
		if !pending {
			break
		}
		select {
		case <-watches[0]:
		case <-ctx.Done():
			t.Fatal("tables not initialized in time")
		}
	}
	addr, err := server.Addr(ctx)
	if err != nil {
		t.Fatal(err)
	}
	a.GRPCAddr = addr.String()
	// The local API is a job of its own; its socket is put in place once
	// it listens.
	for {
		if _, err := os.Stat(client.SocketPath(stateDir)); err == nil {
			break
		}
		select {
		case <-time.After(5 * time.Millisecond):
		case <-ctx.Done():
			t.Fatal("the local API socket did not appear in time")
		}
	}
	return a
}

// RootPEM is the trust bundle the agent wrote for clients.
func (a *Agent) RootPEM(t testing.TB) []byte {
	b, err := os.ReadFile(filepath.Join(a.StateDir, "ca", identity.RootCertFile))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// Dial connects to the gRPC listener trusting only the agent's bundle, as
// ztunnel does with XDS_ROOT_CA.
func (a *Agent) Dial(t testing.TB) *grpc.ClientConn {
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(a.RootPEM(t)) {
		t.Fatal("root-cert.pem holds no certificate")
	}
	conn, err := grpc.NewClient(a.GRPCAddr, grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{RootCAs: pool})))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// WriteManifest replaces a manifest file atomically.
func (a *Agent) WriteManifest(t testing.TB, name, content string) {
	if err := manifesttest.Write(a.Manifests, name, []byte(content)); err != nil {
		t.Fatal(err)
	}
}
