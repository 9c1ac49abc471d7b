// SPDX-License-Identifier: Apache-2.0

package api

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/net/netutil"

	"github.com/mtlsbridge/mtlsbridge/api/client"
	"github.com/mtlsbridge/mtlsbridge/statedir"
)

type serverParams struct {
	cell.In

	Config   Config
	Dir      statedir.Dir
	Log      *slog.Logger
	DB       *statedb.DB
	Jobs     job.Registry
	Health   cell.Health
	Metrics  *prometheus.Registry
	Handlers []Handler `group:"api-handlers"`
	Checks   []Check   `group:"readiness-checks"`
}

// StatedbPrefix is where statedb's HTTP API (/dump, /dump/TABLE, /query,
// /changes/TABLE) is mounted. /metrics and /healthz sit beside it.
const StatedbPrefix = "/statedb"

func registerServer(p serverParams) {
	// Bounded: over TCP, anyone who reaches a node address may scrape.
	metrics := promhttp.HandlerFor(p.Metrics, promhttp.HandlerOpts{MaxRequestsInFlight: 4, Timeout: tcpTimeout})
	healthz := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		writeHealth(w, health(p.DB, p.Checks))
	})
	mux := http.NewServeMux()
	mux.Handle(StatedbPrefix+"/", http.StripPrefix(StatedbPrefix, p.DB.HTTPHandler()))
	mux.Handle("GET /metrics", metrics)
	mux.Handle("GET /healthz", healthz)
	for _, h := range p.Handlers {
		mux.Handle(h.Pattern, h.Handler)
	}
	if p.Config.Pprof {
		mux.HandleFunc("GET /debug/pprof/", pprof.Index)
		mux.HandleFunc("GET /debug/pprof/cmdline", pprof.Cmdline)
		mux.HandleFunc("GET /debug/pprof/symbol", pprof.Symbol)
		mux.HandleFunc("GET /debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("GET /debug/pprof/trace", pprof.Trace)
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	sock := p.Dir.Path(client.APISocket)
	jobs := p.Jobs.NewGroup(p.Health)
	// Over TCP, one route each: the tables and the other routes stay on
	// the private socket.
	for _, s := range []struct {
		job, addr, pattern string
		handler            http.Handler
	}{
		{"serve-metrics", p.Config.PrometheusServeAddr, "GET /metrics", metrics},
		{"serve-health", p.Config.HealthServeAddr, "GET /healthz", healthz},
	} {
		if s.addr != "" {
			jobs.Add(serveTCP(p.Log, s.job, s.addr, s.pattern, s.handler))
		}
	}
	jobs.Add(job.OneShot("serve", func(ctx context.Context, health cell.Health) error {
		// Only the agent's user may talk to the agent: the socket is
		// 0600 in a 0700 folder from its first moment.
		l, err := statedir.ListenUnix(sock)
		if err != nil {
			return fmt.Errorf("listen on %s: %w", sock, err)
		}
		defer statedir.CloseUnix(l, sock)
		p.Log.Info("Serving the local API", "socket", sock)
		health.OK("serving on " + sock)
		return serveUntil(ctx, srv, l)
	}))
}

// Bounds of the TCP listeners, which anyone who reaches the address may
// use: connections at once, and the time to read a request or write an
// answer.
const (
	tcpMaxConnections = 32
	tcpTimeout        = 10 * time.Second
)

// serveTCP serves one route on a TCP address. An address that cannot be
// listened on (a port taken) is retried, with the job's health degraded.
func serveTCP(log *slog.Logger, name, addr, pattern string, h http.Handler) job.Job {
	mux := http.NewServeMux()
	mux.Handle(pattern, h)
	return job.OneShot(name, func(ctx context.Context, health cell.Health) error {
		l, err := net.Listen("tcp", addr)
		if err != nil {
			return fmt.Errorf("listen on %s: %w", addr, err)
		}
		l = netutil.LimitListener(l, tcpMaxConnections)
		srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second, ReadTimeout: tcpTimeout,
			WriteTimeout: tcpTimeout, IdleTimeout: time.Minute, MaxHeaderBytes: 16 << 10}
		log.Info("Serving over TCP", "route", pattern, "address", l.Addr())
		health.OK(fmt.Sprintf("serving %s on %s", pattern, l.Addr()))
		return serveUntil(ctx, srv, l)
	}, job.WithRetry(-1, &job.ExponentialBackoff{Min: time.Second, Max: 30 * time.Second}))
}

// serveUntil serves on l until ctx ends.
func serveUntil(ctx context.Context, srv *http.Server, l net.Listener) error {
	go func() {
		<-ctx.Done()
		srv.Close()
	}()
	if err := srv.Serve(l); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// Health is the answer of /healthz.
type Health struct {
	// Ready is true once every table has been initialized by its sources
	// and derivations and no Check fails.
	Ready bool `json:"ready"`
	// Pending lists the tables still waiting, with their pending initializers.
	Pending map[string][]string `json:"pending,omitempty"`
	// Failing names each failing check of the node's service, with why.
	Failing map[string]string `json:"failing,omitempty"`
	// Warnings are conditions an operator should know of that do not
	// stop the agent from being ready.
	Warnings map[string]string `json:"warnings,omitempty"`
}

// Check is a condition of the agent's readiness beyond its tables: a
// dependency of what the node's mTLS agent is served (CA material, token
// reviews, the node's taint). A Warning check is reported without making
// the agent unready.
type Check struct {
	Name    string
	Err     func() error
	Warning bool
}

// CheckOut adds a Check.
type CheckOut struct {
	cell.Out

	Check Check `group:"readiness-checks"`
}

// health computes the agent's readiness now.
func health(db *statedb.DB, checks []Check) Health {
	txn := db.ReadTxn()
	h := Health{Pending: map[string][]string{}, Failing: map[string]string{}, Warnings: map[string]string{}}
	for _, t := range db.GetTables(txn) {
		if pending := t.PendingInitializers(txn); len(pending) > 0 {
			h.Pending[t.Name()] = pending
		}
	}
	for _, c := range checks {
		if err := c.Err(); err != nil {
			if c.Warning {
				h.Warnings[c.Name] = err.Error()
			} else {
				h.Failing[c.Name] = err.Error()
			}
		}
	}
	h.Ready = len(h.Pending) == 0 && len(h.Failing) == 0
	return h
}

func writeHealth(w http.ResponseWriter, h Health) {
	w.Header().Set("Content-Type", "application/json")
	if !h.Ready {
		w.WriteHeader(http.StatusServiceUnavailable)
	}
	json.NewEncoder(w).Encode(h)
}
