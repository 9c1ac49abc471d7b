// SPDX-License-Identifier: Apache-2.0

// Package api serves the agent's local interfaces on UNIX sockets in the
// private state folder: the HTTP API on api.sock (statedb's table dumps,
// health, metrics, and the routes other cells add: the bypass check, the
// CNI plugin's questions) and a read-only shell on shell.sock. Package
// api/client is their client.
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
}

var defaultConfig = Config{}

// Flags implements cell.Flagger.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.Bool("pprof", def.Pprof, "Serve Go's pprof profiles on the local API socket under /debug/pprof/")
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
