// SPDX-License-Identifier: Apache-2.0

package api_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"

	"github.com/mtlsbridge/mtlsbridge/api"
	"github.com/mtlsbridge/mtlsbridge/api/client"
	"github.com/mtlsbridge/mtlsbridge/metrics"
	"github.com/mtlsbridge/mtlsbridge/statedir"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// apiHive serves the local API of a hive with one table (namespaces), a
// readiness check and a warning the test controls, and one added route.
type apiHive struct {
	stateDir   string
	db         *statedb.DB
	namespaces statedb.RWTable[*tables.Namespace]
	initDone   func(statedb.WriteTxn)
	checkErr   atomic.Pointer[error]
}

func startAPI(t *testing.T, args ...string) *apiHive {
	stateDir, err := os.MkdirTemp("", "mtlsb-api-") // short: socket paths
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(stateDir) })
	a := &apiHive{stateDir: stateDir}
	var none error
	a.checkErr.Store(&none)
	h := hive.New(
		cell.SimpleHealthCell, job.Cell, statedb.Cell, metrics.Cell, statedir.Cell, api.Cell,
		cell.Provide(
			tables.NewNamespacesTable,
			func() api.CheckOut {
				return api.CheckOut{Check: api.Check{Name: "dependency", Err: func() error { return *a.checkErr.Load() }}}
			},
			func() api.HandlerOut {
				return api.HandlerOut{Handler: api.Handler{Pattern: "GET /v1/hello", Handler: http.HandlerFunc(
					func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, "hello") })}}
			},
		),
		cell.Provide(func() api.CheckOut {
			return api.CheckOut{Check: api.Check{Name: "advice", Warning: true, Err: func() error { return errors.New("consider this") }}}
		}),
		cell.Invoke(func(db *statedb.DB, ns statedb.RWTable[*tables.Namespace]) {
			a.db, a.namespaces = db, ns
			txn := db.WriteTxn(ns)
			a.initDone = ns.RegisterInitializer(txn, "test")
			txn.Commit()
		}),
	)
	flags := pflag.NewFlagSet("", pflag.ContinueOnError)
	h.RegisterFlags(flags)
	if err := flags.Parse(append([]string{"--state-dir=" + stateDir}, args...)); err != nil {
		t.Fatal(err)
	}
	log := hivetest.Logger(t)
	if err := h.Start(log, t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Stop(log, context.Background()) })
	return a
}

func (a *apiHive) health(t *testing.T) (int, api.Health) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		resp, err := client.New(a.stateDir).Do(t.Context(), http.MethodGet, "/healthz", "", nil)
		if err == nil {
			defer resp.Body.Close()
			var h api.Health
			if err := json.NewDecoder(resp.Body).Decode(&h); err != nil {
				t.Fatal(err)
			}
			return resp.StatusCode, h
		}
		if time.Now().After(deadline) {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// /healthz is ready only once every table is initialized and every check
// passes; it names what it waits for and what fails; warnings do not
// make it unready.
func TestHealthz(t *testing.T) {
	a := startAPI(t)
	code, h := a.health(t)
	if code != http.StatusServiceUnavailable || h.Ready || len(h.Pending["namespaces"]) != 1 {
		t.Fatalf("before initialization: %d %+v", code, h)
	}
	if h.Warnings["advice"] != "consider this" {
		t.Errorf("warnings %v", h.Warnings)
	}

	txn := a.db.WriteTxn(a.namespaces)
	a.initDone(txn)
	txn.Commit()
	broken := errors.New("the CA is gone")
	a.checkErr.Store(&broken)
	if code, h := a.health(t); code != http.StatusServiceUnavailable || h.Ready || h.Failing["dependency"] != "the CA is gone" {
		t.Fatalf("a failing check: %d %+v", code, h)
	}
	var none error
	a.checkErr.Store(&none)
	if code, h := a.health(t); code != http.StatusOK || !h.Ready || len(h.Failing) != 0 || h.Warnings["advice"] == "" {
		t.Fatalf("ready with a warning: %d %+v", code, h)
	}
}

// The routes: statedb's dump, metrics with the process's own, added routes.
func TestRoutes(t *testing.T) {
	a := startAPI(t)
	a.health(t) // serving
	txn := a.db.WriteTxn(a.namespaces)
	a.namespaces.Insert(txn, &tables.Namespace{Name: "app"})
	txn.Commit()
	get := func(path string) string {
		resp, err := client.New(a.stateDir).Do(t.Context(), http.MethodGet, path, "", nil)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("GET %s: %s", path, resp.Status)
		}
		return string(b)
	}
	if body := get(api.StatedbPrefix + "/dump"); !strings.Contains(body, `"namespaces"`) || !strings.Contains(body, `"app"`) {
		t.Errorf("dump: %s", body)
	}
	if body := get("/metrics"); !strings.Contains(body, "process_resident_memory_bytes") {
		t.Error("metrics without the process's own")
	}
	if body := get("/v1/hello"); body != "hello" {
		t.Errorf("added route: %q", body)
	}
}

// Profiles are served only when asked for with --pprof.
func TestPprof(t *testing.T) {
	status := func(a *apiHive, path string) (int, []byte) {
		resp, err := client.New(a.stateDir).Do(t.Context(), http.MethodGet, path, "", nil)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, b
	}
	plain := startAPI(t)
	plain.health(t) // serving
	if code, _ := status(plain, "/debug/pprof/heap"); code != http.StatusNotFound {
		t.Errorf("heap profile without --pprof: %d, want 404", code)
	}
	a := startAPI(t, "--pprof")
	a.health(t)
	// A profile in pprof's format: gzipped protobuf.
	if code, b := status(a, "/debug/pprof/heap"); code != http.StatusOK || !bytes.HasPrefix(b, []byte{0x1f, 0x8b}) {
		t.Errorf("heap profile with --pprof: %d, %.40q", code, b)
	}
	// The index's links work: the command line names the test binary.
	if code, b := status(a, "/debug/pprof/cmdline"); code != http.StatusOK || len(b) == 0 {
		t.Errorf("command line with --pprof: %d, %q", code, b)
	}
}

// The shell offers the commands that read, and nothing else.
func TestShellReadsOnly(t *testing.T) {
	a := startAPI(t)
	// The shell listens in a job of its own: the first command waits for
	// it (within 10s), as the API's first request does (health).
	var out strings.Builder
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		out.Reset()
		err := client.Shell(t.Context(), a.stateDir, &out, "db")
		if err == nil || time.Now().After(deadline) {
			if err != nil || !strings.Contains(out.String(), "namespaces") {
				t.Fatalf("db: %v %q", err, out.String())
			}
			break
		}
	}
	for _, line := range []string{"exec id", "cat /etc/hostname", "db/insert namespaces x.yaml", "db/delete namespaces x.yaml",
		"db/show --out=/tmp/x namespaces", "db/dump"} {
		if err := client.Shell(t.Context(), a.stateDir, io.Discard, line); err == nil {
			t.Errorf("the shell ran %q", line)
		}
	}
}

// --prometheus-serve-addr and --health-serve-addr serve /metrics and
// /healthz over TCP, each alone: nothing else of the API is reachable
// there. A port already taken is retried until it is free.
func TestServeTCP(t *testing.T) {
	metricsAddr, healthAddr := freeLoopbackAddr(t), freeLoopbackAddr(t)
	taken, err := net.Listen("tcp", healthAddr)
	if err != nil {
		t.Fatal(err)
	}
	a := startAPI(t, "--prometheus-serve-addr="+metricsAddr, "--health-serve-addr="+healthAddr)
	get := func(addr, path string) (int, string) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for {
			resp, err := http.Get("http://" + addr + path)
			if err == nil {
				defer resp.Body.Close()
				b, _ := io.ReadAll(resp.Body)
				return resp.StatusCode, string(b)
			}
			if time.Now().After(deadline) {
				t.Fatalf("GET %s%s: %v", addr, path, err)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	if code, body := get(metricsAddr, "/metrics"); code != http.StatusOK || !strings.Contains(body, "process_resident_memory_bytes") {
		t.Errorf("metrics over TCP: %d %.80q", code, body)
	}
	for _, path := range []string{"/healthz", api.StatedbPrefix + "/dump", "/v1/hello"} {
		if code, _ := get(metricsAddr, path); code != http.StatusNotFound {
			t.Errorf("GET %s on the metrics address: %d, want 404", path, code)
		}
	}

	// Connections are bounded: with the budget (32) taken by clients that
	// send nothing, a scrape waits; once they go, it is served.
	var held []net.Conn
	for range 40 {
		c, err := net.Dial("tcp", metricsAddr)
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, c)
	}
	fresh := &http.Client{Timeout: time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	if resp, err := fresh.Get("http://" + metricsAddr + "/metrics"); err == nil {
		resp.Body.Close()
		t.Errorf("a scrape beyond the connection budget was served: %s", resp.Status)
	}
	for _, c := range held {
		c.Close()
	}
	if resp, err := fresh.Get("http://" + metricsAddr + "/metrics"); err != nil {
		t.Errorf("a scrape once the idle clients went: %v", err)
	} else {
		resp.Body.Close()
	}

	// The health address was taken at start: it is served once freed.
	taken.Close()
	if code, body := get(healthAddr, "/healthz"); code != http.StatusServiceUnavailable || !strings.Contains(body, `"namespaces"`) {
		t.Errorf("health over TCP before initialization: %d %s", code, body)
	}
	txn := a.db.WriteTxn(a.namespaces)
	a.initDone(txn)
	txn.Commit()
	if code, body := get(healthAddr, "/healthz"); code != http.StatusOK {
		t.Errorf("health over TCP once ready: %d %s", code, body)
	}
	for _, path := range []string{"/metrics", api.StatedbPrefix + "/dump", "/v1/hello"} {
		if code, _ := get(healthAddr, path); code != http.StatusNotFound {
			t.Errorf("GET %s on the health address: %d, want 404", path, code)
		}
	}
}

// freeLoopbackAddr returns an address on the loopback that was free a
// moment ago.
func freeLoopbackAddr(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}
