// SPDX-License-Identifier: Apache-2.0

package enrollment

import (
	"strconv"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"

	"github.com/mtlsbridge/mtlsbridge/tables"
)

// TableName is the name of the enrollments table.
const TableName = "enrollments"

// Enrollment is the decision for one pod: whether its traffic goes through
// the mTLS agent, and the rule that decided.
type Enrollment struct {
	Namespace string `json:"namespace"`
	Pod       string `json:"pod"`
	UID       string `json:"uid,omitempty"`
	Node      string `json:"node"`
	Enrolled  bool   `json:"enrolled"`
	// Reason names the rule that decided, e.g. "label:cilium.io/redir-type=workload",
	// "policy:cnp/NS/NAME", "namespace-label", "excluded:host-network".
	Reason string `json:"reason"`
	// Policy is the key of the policy that enrolled the pod, if one did.
	Policy string `json:"policy,omitempty"`
	// AwaitingIP is true for a pod the rules enroll that has no address
	// yet (Reason excluded:no-ip): none of its traffic is redirected, but
	// it holds its identities.
	AwaitingIP bool `json:"awaitingIP,omitempty"`
	// SpiffeID and IdentitySpiffeID are the identities an enrolled pod, or
	// one awaiting its address, may hold (the second once Cilium has
	// allocated a security identity).
	SpiffeID         string `json:"spiffeID,omitempty"`
	IdentitySpiffeID string `json:"identitySpiffeID,omitempty"`
	// MTLSAgent is true for the mTLS agent pod of its node.
	MTLSAgent bool `json:"mtlsAgent"`
	// IgnoredOptOut is true when the pod carries the opt-out label but a
	// policy that requires authentication selects it: it stays enrolled.
	IgnoredOptOut bool `json:"ignoredOptOut,omitempty"`
	// IgnoredAgentLabel is true when the pod carries the mTLS agent's label
	// outside --mtls-agent-namespaces: it is an ordinary pod.
	IgnoredAgentLabel bool `json:"ignoredAgentLabel,omitempty"`
}

// Notes of rows whose labels were ignored.
const (
	NoteIgnoredOptOut     = "opt-out label ignored: a policy requires authentication"
	NoteIgnoredAgentLabel = "mTLS agent label ignored: namespace not in --mtls-agent-namespaces"
	NoteAwaitingIP        = "enrolled once it has an address; its identity may be signed already"
)

func (e *Enrollment) Scope() tables.Scope { return tables.PodScope(e.Key(), e.Node) }

// Key is the primary key, "namespace/pod".
func (e *Enrollment) Key() string { return e.Namespace + "/" + e.Pod }

func (e *Enrollment) TableHeader() []string {
	return []string{"Pod", "Node", "Enrolled", "Reason", "SpiffeID", "IdentitySpiffeID", "MTLSAgent", "Note"}
}

// Note says that the pod awaits its address, or else which of its labels
// the decision ignored.
func (e *Enrollment) Note() string {
	switch {
	case e.AwaitingIP:
		return NoteAwaitingIP
	case e.IgnoredOptOut:
		return NoteIgnoredOptOut
	case e.IgnoredAgentLabel:
		return NoteIgnoredAgentLabel
	}
	return ""
}

// Holds reports whether the pod may be given the identity id: it is
// enrolled, or awaits the address that enrolls it, and id is one of its.
func (e *Enrollment) Holds(id string) bool {
	return (e.Enrolled || e.AwaitingIP) && (id == e.SpiffeID || id == e.IdentitySpiffeID)
}

func (e *Enrollment) TableRow() []string {
	return []string{e.Key(), tables.Dash(e.Node), strconv.FormatBool(e.Enrolled), e.Reason,
		tables.Dash(e.SpiffeID), tables.Dash(e.IdentitySpiffeID), strconv.FormatBool(e.MTLSAgent), tables.Dash(e.Note())}
}

var (
	keyIndex = statedb.Index[*Enrollment, string]{
		Name:       "name",
		FromObject: func(e *Enrollment) index.KeySet { return index.NewKeySet(index.String(e.Key())) },
		FromKey:    index.String,
		FromString: index.FromString,
		Unique:     true,
	}
	policyIndex = statedb.Index[*Enrollment, string]{
		Name: "policy",
		FromObject: func(e *Enrollment) index.KeySet {
			if e.Policy == "" {
				return index.KeySet{}
			}
			return index.NewKeySet(tables.ExactKey(e.Policy))
		},
		FromKey:    tables.ExactKey,
		FromString: tables.ExactKeyFromString,
	}

	// ByKey queries the enrollment of the pod "namespace/name".
	ByKey = keyIndex.Query
	// ByPolicy queries the pods a policy enrolled (by tables.Policy.Key()).
	ByPolicy = policyIndex.Query
)

// localIndex holds the rows of node's pods, the only node whose rows are
// looked up as a set (redirections, certificates, the bypass check).
func localIndex(node string) statedb.Index[*Enrollment, bool] {
	return statedb.Index[*Enrollment, bool]{
		Name: "local",
		FromObject: func(e *Enrollment) index.KeySet {
			if node == "" || e.Node != node {
				return index.KeySet{}
			}
			return index.NewKeySet(index.Bool(true))
		},
		FromKey:    index.Bool,
		FromString: index.BoolString,
	}
}

// OfThisNode queries the rows of the pods of the agent's node.
func OfThisNode() statedb.Query[*Enrollment] { return localIndex("").Query(true) }

// NewTable creates the enrollments table of the agent of node.
func NewTable(db *statedb.DB, node tables.LocalNode) (statedb.RWTable[*Enrollment], error) {
	return statedb.NewTable(db, TableName, keyIndex, localIndex(node.NodeName), policyIndex)
}
