// SPDX-License-Identifier: Apache-2.0

// Package cni is the agent side of the fail-closed pod start: the local
// API route the mtlsbridge-cni plugin asks at every CNI ADD, the rows of
// the cni-pods table (tables.CNIPod) with what the plugin reported, kept in
// the state folder across restarts, and the installer that keeps the
// plugin chained last in the node's (Cilium's) conflist. The plugin itself
// is package cni/plugin; file operations are package cni/install.
package cni

import (
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/spf13/pflag"

	"github.com/mtlsbridge/mtlsbridge/cni/install"
	"github.com/mtlsbridge/mtlsbridge/cni/plugin"
	"github.com/mtlsbridge/mtlsbridge/statedir"
)

// Cell answers the CNI plugin and, with --cni-install, installs it.
var Cell = cell.Module(
	"cni",
	"Chained CNI plugin that holds enrolled pods until their redirection is in place",

	cell.Config(defaultConfig),
	// mtlsbridge_cni_answer_seconds.
	cell.ProvidePrivate(newMetrics),
	// cni-pods rows as files in the state folder.
	cell.ProvidePrivate(func(dir statedir.Dir) *store { return newStore(string(dir)) }),
	// cni-pods rows kept on disk: the plugin's reports and the in-pod
	// mode's findings.
	cell.Provide(newReports),
	// POST /v1/cni/pods/NS/NAME and DELETE /v1/cni/containers/ID on api.sock
	// write cni-pods.
	cell.Provide(newHandlers),
	// Rows of the previous agent come back at start; rows of pods gone from
	// the API go, whether or not a DEL came.
	cell.Invoke(registerStore),
	// The plugin binary and its conflist entry, kept in place while the
	// agent runs and left in place when it stops.
	cell.Invoke(registerInstaller),
)

// Config of the plugin and its installation.
type Config struct {
	// CNIInstall installs the plugin (flag --cni-install, default false so
	// that tests and the demo never touch the host).
	CNIInstall bool
	// CNIConfDir and CNIBinDir are the node's CNI folders.
	CNIConfDir string
	CNIBinDir  string
	// CNIConflist names the conflist to chain into; empty: 05-cilium.conflist
	// when present, else the first *.conflist by name.
	CNIConflist string
	// CNIPluginBinary is the plugin to copy; empty: mtlsbridge-cni next to
	// the agent's own executable.
	CNIPluginBinary string
	// CNIFailPolicy is what ADD does when the agent cannot be reached:
	// "closed" (fail, the kubelet retries) or "open" (start unprotected).
	CNIFailPolicy string
	// CNIWait bounds how long ADD waits for an enrolled pod's redirection.
	CNIWait time.Duration
}

var defaultConfig = Config{
	CNIConfDir:    "/etc/cni/net.d",
	CNIBinDir:     "/opt/cni/bin",
	CNIFailPolicy: plugin.FailClosed,
	CNIWait:       plugin.DefaultWaitTimeout,
}

// Flags implements cell.Flagger.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.Bool("cni-install", def.CNIInstall, "Install the mtlsbridge-cni plugin into the node's CNI configuration (never removed on stop; see mtlsbridge-cni uninstall)")
	flags.String("cni-conf-dir", def.CNIConfDir, "CNI configuration folder of the node")
	flags.String("cni-bin-dir", def.CNIBinDir, "CNI plugin folder of the node")
	flags.String("cni-conflist", def.CNIConflist, "Conflist to chain into (default "+install.PreferredConflist+" if present, else the first *.conflist by name)")
	flags.String("cni-plugin-binary", def.CNIPluginBinary, "Plugin binary to install (default mtlsbridge-cni next to the agent's executable)")
	flags.String("cni-fail-policy", def.CNIFailPolicy, "When the agent cannot be reached at pod start: closed (refuse, the kubelet retries) or open (start the pod WITHOUT mTLS)")
	flags.Duration("cni-wait", def.CNIWait, "How long pod start waits for an enrolled pod's redirection before failing")
}

func (c Config) validate() error {
	if c.CNIFailPolicy != plugin.FailClosed && c.CNIFailPolicy != plugin.FailOpen {
		return fmt.Errorf("--cni-fail-policy: %q: want %q or %q", c.CNIFailPolicy, plugin.FailClosed, plugin.FailOpen)
	}
	if c.CNIWait <= 0 {
		return fmt.Errorf("--cni-wait: %s: must be positive", c.CNIWait)
	}
	return nil
}

func (c Config) pluginBinary() (string, error) {
	if c.CNIPluginBinary != "" {
		return c.CNIPluginBinary, nil
	}
	self, err := os.Executable()
	if err != nil {
		return "", fmt.Errorf("--cni-plugin-binary: %w", err)
	}
	return filepath.Join(filepath.Dir(self), install.PluginType), nil
}
