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
)

// Cell serves the local API and the shell.
var Cell = cell.Module(
	"api",
	"Local HTTP API and read-only shell on UNIX sockets",

	// api.sock: statedb dumps, /healthz, /metrics and the routes of HandlerOut.
	cell.Invoke(registerServer),
	// shell.sock: the script commands that only read.
	cell.Invoke(registerShell),
	// show: rows filtered by namespace, pod or node, as a table, JSON or
	// YAML, once or as they change (db show).
	cell.Provide(showCmd),
)

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
