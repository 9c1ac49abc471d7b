// SPDX-License-Identifier: Apache-2.0

package statedir

import (
	"fmt"
	"path/filepath"

	"github.com/cilium/hive/cell"
	"github.com/spf13/pflag"
)

// Cell provides the prepared state folder.
var Cell = cell.Module(
	"statedir",
	"Private state folder of the agent on the node",

	cell.Config(DefaultConfig),
	// Prepared once, before any component writes there.
	cell.Provide(newDir),
)

// Config locates the state folder.
type Config struct {
	// StateDir holds the agent's sockets and state (flag --state-dir).
	StateDir string
}

// DefaultConfig is the state folder of a node installation: under /var/run,
// cleared at boot like the pinned BPF state.
var DefaultConfig = Config{StateDir: "/var/run/mtlsbridge"}

// Flag names the flag shared by the agent and its command-line clients.
const Flag = "state-dir"

// Flags implements cell.Flagger.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.String(Flag, def.StateDir, "Folder for the agent's sockets and state (made private to the agent's user)")
}

// Dir is the prepared state folder.
type Dir string

// Path joins elements onto the folder.
func (d Dir) Path(elem ...string) string {
	return filepath.Join(append([]string{string(d)}, elem...)...)
}

func newDir(cfg Config) (Dir, error) {
	if cfg.StateDir == "" {
		return "", fmt.Errorf("--%s must not be empty", Flag)
	}
	if err := Prepare(cfg.StateDir); err != nil {
		return "", fmt.Errorf("--%s: %w", Flag, err)
	}
	return Dir(cfg.StateDir), nil
}
