// SPDX-License-Identifier: Apache-2.0

// Package api serves the agent's local interfaces on UNIX sockets in the
// private state folder: the HTTP API on api.sock (statedb's table dumps,
// health, metrics, and the routes other cells add: the bypass check, the
// CNI plugin's questions) and a read-only shell on shell.sock. Package
// api/client is their client. Metrics and health alone may also be served
// over TCP, for Prometheus and the kubelet.
package api

import (
	"net/http"

	"github.com/cilium/hive/cell"
	"github.com/spf13/pflag"
)

// Cell serves the local API and the shell.
var Cell = cell.Module(
	"api",
	"Local HTTP API and read-only shell on UNIX sockets",

	cell.Config(defaultConfig),
	// api.sock: statedb dumps, /healthz, /metrics and the routes of HandlerOut.
	cell.Invoke(registerServer),
	// shell.sock: the script commands that only read.
	cell.Invoke(registerShell),
	// show: rows filtered by namespace, pod or node, as a table, JSON or
	// YAML, once or as they change (db show).
	cell.Provide(showCmd),
)

// Config of the local API.
type Config struct {
	// Pprof serves Go's profiles under /debug/pprof/ (flag --pprof), as
	// cilium-agent's --pprof does, but on api.sock: only the agent's user
	// can read them.
	Pprof bool
	// PrometheusServeAddr serves /metrics, and nothing else, over TCP for
	// Prometheus (flag --prometheus-serve-addr, as cilium-agent's; empty:
	// on api.sock only).
	PrometheusServeAddr string
	// HealthServeAddr serves /healthz, and nothing else, over TCP for the
	// kubelet's probes (flag --health-serve-addr; empty: on api.sock only).
	HealthServeAddr string
}

var defaultConfig = Config{}

// Flags implements cell.Flagger.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.Bool("pprof", def.Pprof, "Serve Go's pprof profiles on the local API socket under /debug/pprof/")
	flags.String("prometheus-serve-addr", def.PrometheusServeAddr, "TCP address serving /metrics (only) for Prometheus, e.g. :9967; empty: the local API socket only")
	flags.String("health-serve-addr", def.HealthServeAddr, "TCP address serving /healthz (only) for the kubelet's probes, e.g. 127.0.0.1:9968; empty: the local API socket only")
}

// Handler serves one route of the local API, e.g. "GET /v1/bypass".
type Handler struct {
	Pattern string
	Handler http.Handler
}

// HandlerOut adds a route to the local API.
type HandlerOut struct {
	cell.Out

	Handler Handler `group:"api-handlers"`
}
