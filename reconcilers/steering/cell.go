// SPDX-License-Identifier: Apache-2.0

// Package steering is the seam between the redirection modes and those who
// need to know whether a pod's TCP really goes through the node's mTLS
// agent: readiness (and with it the Workloads' HBONE), the CNI route that
// holds a pod's start, and the bypass check. Both modes are in every agent
// and derive from the same enrollments; --redirect-mode says which one
// acts. Each mode provides a Mode into a value group; Modes.Active picks
// the one the flag names, so that the askers never call a mode directly.
package steering

import (
	"fmt"

	"github.com/cilium/hive/cell"
	"github.com/spf13/pflag"
)

// Cell holds the --redirect-mode flag.
var Cell = cell.Module(
	"steering",
	"Which redirection mode steers enrolled pods to the mTLS agent",

	cell.Config(defaultConfig),
	// A mode that does not exist stops the agent at start, naming the flag.
	cell.Invoke(Config.validate),
	// Both modes see what Cilium's socket LB made of a Service address.
	cell.Provide(checkServices),
)

// Mode names, the values of --redirect-mode.
const (
	// ModeL2 is CFP-32759's mode: BPF steers enrolled pods' TCP at L2 to
	// the mTLS agent in its own network namespace (package redirect).
	ModeL2 = "l2"
	// ModeInPod is ztunnel's in-pod mode: the agent writes the redirection
	// into each enrolled pod's network namespace and hands the namespace
	// to the mTLS agent over ZDS (package inpod).
	ModeInPod = "inpod"
)

// Config of the mode.
type Config struct {
	// RedirectMode is ModeL2 or ModeInPod (flag --redirect-mode).
	RedirectMode string
	// CiliumConfigDir is where Cilium's agent reads its configuration,
	// one file per key (flag --cilium-config-dir; empty: not checked).
	CiliumConfigDir string
}

var defaultConfig = Config{RedirectMode: ModeL2}

// Flags implements cell.Flagger.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.String("redirect-mode", def.RedirectMode,
		"How enrolled pods' TCP reaches the mTLS agent: l2 (BPF redirect to the agent's namespace, CFP-32759) or inpod (redirection inside each pod, namespaces handed to ztunnel over ZDS)")
	flags.String("cilium-config-dir", def.CiliumConfigDir,
		"Folder of Cilium's effective configuration (one file per key); checked at start: Services must be translated at the socket in pods' namespaces")
}

// Mode is the mode the configuration names. The zero Config (a hive
// without this cell, as the datapath's own tests build) means ModeL2.
func (c Config) Mode() string {
	if c.RedirectMode == "" {
		return ModeL2
	}
	return c.RedirectMode
}

func (c Config) validate() error {
	switch c.Mode() {
	case ModeL2, ModeInPod:
		return nil
	}
	return fmt.Errorf("--redirect-mode=%s: want %s or %s", c.RedirectMode, ModeL2, ModeInPod)
}
