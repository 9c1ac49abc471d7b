// SPDX-License-Identifier: Apache-2.0

// Package api serves the agent's local HTTP API on a UNIX socket in the
// state folder: statedb's table dumps and the health of the agent. The
// `mtlsbridge db` commands are its client.
package api

import (
	"net/http"
	"path/filepath"

	"github.com/cilium/hive/cell"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/pflag"
)

// Cell serves the local API.
var Cell = cell.Module(
	"api",
	"Local HTTP API on a UNIX socket",

	cell.Config(DefaultConfig),
	// Every component registers its metrics here; /metrics serves them.
	cell.Provide(prometheus.NewRegistry),
	cell.Invoke(registerServer),
)

// Config locates the agent's state.
type Config struct {
	// StateDir holds the agent's sockets and state (flag --state-dir).
	StateDir string
}

// DefaultConfig is the state folder of a node installation.
var DefaultConfig = Config{StateDir: "/var/run/mtlsbridge"}

// StateDirFlag names the flag shared by the agent and its clients.
const StateDirFlag = "state-dir"

// Flags implements cell.Flagger.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.String(StateDirFlag, def.StateDir, "Folder for the agent's sockets and state")
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

// SocketPath is the API socket in a state folder.
func SocketPath(stateDir string) string { return filepath.Join(stateDir, "api.sock") }

// ShellSocketPath is the hive shell socket in a state folder.
func ShellSocketPath(stateDir string) string { return filepath.Join(stateDir, "shell.sock") }
