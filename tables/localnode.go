// SPDX-License-Identifier: Apache-2.0

package tables

import (
	"os"

	"github.com/spf13/pflag"
)

// LocalNode names the node this agent runs on.
type LocalNode struct {
	// NodeName is the Kubernetes node name (flag --node-name, default from
	// the NODE_NAME environment variable, else the host name).
	NodeName string
}

// Flags implements cell.Flagger.
func (def LocalNode) Flags(flags *pflag.FlagSet) {
	flags.String("node-name", def.NodeName, "Kubernetes name of this node (default $NODE_NAME, else the host name)")
}

// DefaultLocalNode reads the node name from the environment.
func DefaultLocalNode() LocalNode {
	name := os.Getenv("NODE_NAME")
	if name == "" {
		name, _ = os.Hostname()
	}
	return LocalNode{NodeName: name}
}
