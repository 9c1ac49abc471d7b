// SPDX-License-Identifier: Apache-2.0

package grpcserver

import (
	"fmt"
	"slices"
	"strings"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"
	"google.golang.org/grpc/codes"

	"github.com/mtlsbridge/mtlsbridge/tables"
	"github.com/mtlsbridge/mtlsbridge/tables/ingest"
)

// Callers says whom the listener serves. The node agent serves its node's
// mTLS agent pods (the zero value). The signer, which alone holds the CA
// key, serves node agents: each asks only for identities of its own node.
type Callers struct {
	// NodeAgents are the service accounts (NAMESPACE/NAME) of the node
	// agents; empty in the node agent.
	NodeAgents []string
}

// NodeAgentCallersCell makes the listener the signer's: its callers are
// node agents, known by service account and by the node their token is
// bound to. Only TokenReview says both, so the signer runs in Kubernetes
// mode; and it runs on no node of its own (--node-name empty).
var NodeAgentCallersCell = cell.Group(
	cell.Config(defaultNodeAgentConfig),
	cell.Provide(newNodeAgentCallers),
)

func newNodeAgentCallers(c NodeAgentConfig, mode ingest.Mode, node tables.LocalNode) (Callers, error) {
	switch {
	case mode != ingest.Kubernetes:
		return Callers{}, fmt.Errorf("the signer needs --source=k8s: only TokenReview names a node agent's service account and node")
	case node.NodeName != "":
		return Callers{}, fmt.Errorf("--node-name=%q: the signer runs on no node of its own (give --node-name= empty)", node.NodeName)
	case len(c.NodeAgentServiceAccounts) == 0:
		return Callers{}, fmt.Errorf("--node-agent-service-accounts: want at least one")
	}
	for _, sa := range c.NodeAgentServiceAccounts {
		if ns, name, ok := strings.Cut(sa, "/"); !ok || ns == "" || name == "" {
			return Callers{}, fmt.Errorf("--node-agent-service-accounts: %q is not NAMESPACE/NAME", sa)
		}
	}
	return Callers{NodeAgents: c.NodeAgentServiceAccounts}, nil
}

// NodeAgentConfig names the node agents a signer serves.
type NodeAgentConfig struct {
	NodeAgentServiceAccounts []string
}

// The sidecar runs in Cilium's agent pod, with its service account.
var defaultNodeAgentConfig = NodeAgentConfig{NodeAgentServiceAccounts: []string{"kube-system/cilium"}}

// Flags implements cell.Flagger.
func (def NodeAgentConfig) Flags(flags *pflag.FlagSet) {
	flags.StringSlice("node-agent-service-accounts", def.NodeAgentServiceAccounts,
		"Service accounts (NAMESPACE/NAME) of the node agents that may ask for certificates of their node's pods")
}

// allowedNodeAgent checks a caller of the signer: a node agent whose token
// names the node it runs on. The token is its proof: TokenReview checked
// that the pod it is bound to exists, and the node is the one the API
// server wrote into it.
func (a *Authenticator) allowedNodeAgent(_ statedb.ReadTxn, caller Caller) (<-chan struct{}, error) {
	switch {
	case caller.Node == "":
		return nil, refusal(codes.PermissionDenied, "no-node", "token of %s names no node: a node agent's token must be bound to its pod", caller.Key())
	case !slices.Contains(a.callers.NodeAgents, caller.Namespace+"/"+caller.ServiceAccount):
		return nil, refusal(codes.PermissionDenied, "not-node-agent", "service account %s/%s is not a node agent's (--node-agent-service-accounts=%s)",
			caller.Namespace, caller.ServiceAccount, strings.Join(a.callers.NodeAgents, ","))
	}
	return nil, nil
}
