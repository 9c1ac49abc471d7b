// SPDX-License-Identifier: Apache-2.0

package tables

import (
	"slices"
	"strconv"
	"strings"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
	"k8s.io/apimachinery/pkg/labels"
)

// PoliciesTableName is the name of the table of Cilium network policies.
const PoliciesTableName = "policies"

// PolicyKind tells a namespaced policy from a cluster-wide one.
type PolicyKind string

const (
	// KindCNP is a CiliumNetworkPolicy: it selects pods of its own namespace only.
	KindCNP PolicyKind = "cnp"
	// KindCCNP is a CiliumClusterwideNetworkPolicy.
	KindCCNP PolicyKind = "ccnp"
)

// Policy is what mtlsbridge keeps of a CiliumNetworkPolicy or
// CiliumClusterwideNetworkPolicy: whether any of its rules requires
// authentication, and which pods those rules apply to.
type Policy struct {
	Kind      PolicyKind `json:"kind"`
	Namespace string     `json:"namespace,omitempty"`
	Name      string     `json:"name"`

	// Selectors are the endpointSelectors of the rules (spec or specs[]) that
	// require authentication (authentication.mode "required", or the
	// policy's AuthenticationModeAnnotation). Empty when the policy enrolls
	// nothing.
	Selectors []EndpointSelector `json:"selectors,omitempty"`

	// Error is why the policy's current version could not be understood.
	// A policy that was never valid enrolls nothing, as Cilium rejects it,
	// except for a bad AuthenticationModeAnnotation: Cilium ignores it, and
	// the rules that require authentication themselves still enroll.
	Error string `json:"error,omitempty"`
	// LastValidSelectors, set only with Error, are the Selectors of the
	// policy's last valid version, which Selectors also hold: an edit that
	// breaks a policy must not silently unenroll the pods it protects (fail
	// closed).
	LastValidSelectors []EndpointSelector `json:"lastValidSelectors,omitempty"`

	// key caches Key(): the enrollment of every pod compares the keys of
	// the policies that select it.
	key string
}

// KeepLastValid returns the new version of a policy, holding on to the
// selectors of the last valid version before it, besides its own, when new
// is invalid. Invalid versions in between add nothing.
func KeepLastValid(old, new *Policy) *Policy {
	if new.Error == "" || old == nil {
		return new
	}
	valid := old.Selectors
	if old.Error != "" {
		valid = old.LastValidSelectors
	}
	if len(valid) == 0 {
		return new
	}
	c := *new
	c.LastValidSelectors = valid
	c.Selectors = slices.Clone(valid)
	for _, s := range new.Selectors {
		if !slices.ContainsFunc(c.Selectors, func(o EndpointSelector) bool { return o.Text == s.Text }) {
			c.Selectors = append(c.Selectors, s)
		}
	}
	return &c
}

// LastValid reports whether the policy, invalid, enrolls what its last
// valid version selected.
func (p *Policy) LastValid() bool { return len(p.LastValidSelectors) > 0 }

// Key is the primary key: "cnp/NAMESPACE/NAME" or "ccnp/NAME". Enrollment
// reasons name policies by it.
func (p *Policy) Key() string {
	if p.key != "" {
		return p.key
	}
	return PolicyKey(p.Kind, p.Namespace, p.Name)
}

// PolicyKey builds the key of a policy.
func PolicyKey(kind PolicyKind, namespace, name string) string {
	if kind == KindCCNP {
		return string(kind) + "/" + name
	}
	return string(kind) + "/" + namespace + "/" + name
}

// RequiresAuthentication reports whether the policy enrolls the pods it selects.
func (p *Policy) RequiresAuthentication() bool { return len(p.Selectors) > 0 }

// Selects reports whether one of the authenticating rules selects the pod,
// of namespace ns, in the Cilium cluster named cluster. A
// CiliumNetworkPolicy only selects pods in its own namespace.
func (p *Policy) Selects(pod *Pod, ns *Namespace, cluster string) bool {
	if !p.RequiresAuthentication() || (p.Kind == KindCNP && pod.Namespace != p.Namespace) {
		return false
	}
	view := podLabelView{pod: pod, ns: ns, cluster: cluster}
	for _, s := range p.Selectors {
		if s.selector.Matches(view) {
			return true
		}
	}
	return false
}

// Anchors are the keys under which the policy is found from a pod: the
// pod's namespace for a CNP, and for a CCNP one label each selector
// requires (or MatchAll when it requires none).
func (p *Policy) Anchors() []string {
	if p.Kind == KindCNP {
		return []string{LabelKey(NamespaceLabel, p.Namespace)}
	}
	out := make([]string, 0, len(p.Selectors))
	for _, s := range p.Selectors {
		out = append(out, s.Anchor())
	}
	return out
}

func (p *Policy) TableHeader() []string {
	return []string{"Name", "Authentication", "Selectors", "Error", "Notes"}
}

func (p *Policy) TableRow() []string {
	auth := "-"
	switch {
	case p.LastValid():
		auth = "required (last valid version)"
	case p.RequiresAuthentication():
		auth = "required"
	}
	sels := make([]string, len(p.Selectors))
	var notes []string
	for i, s := range p.Selectors {
		sels[i] = strconv.Quote(s.Text)
		if s.Note != "" && !slices.Contains(notes, s.Note) {
			notes = append(notes, s.Note)
		}
	}
	return []string{p.Key(), auth, Dash(strings.Join(sels, " ")), Dash(p.Error), Dash(strings.Join(notes, "; "))}
}

// EndpointSelector is a parsed Cilium endpointSelector.
type EndpointSelector struct {
	// Text is the selector in Kubernetes label selector syntax, Cilium's
	// source prefixes removed ("" selects every pod).
	Text string `json:"text"`
	// Note names the labels the selector asks for that no pod carries
	// in Cilium, so that a policy enrolling nobody says why.
	Note string `json:"note,omitempty"`

	selector labels.Selector
	// anchor is one "key=value" the selector requires, or "" when it
	// requires none (then every pod is a candidate).
	anchor string
}

// Anchor is the label (LabelKey form) every selected pod carries, or
// MatchAll when there is none.
func (s EndpointSelector) Anchor() string {
	if s.anchor == "" {
		return MatchAll
	}
	return s.anchor
}

// Namespace returns the namespace the selector requires, if it requires one.
func (s EndpointSelector) Namespace() (string, bool) {
	return strings.CutPrefix(s.anchor, NamespaceLabel+"=")
}

// MatchAll is the anchor of selectors that do not require a specific label.
const MatchAll = "*"

// podLabelView presents a pod to a label selector the way Cilium labels
// its endpoints: its own labels plus the pseudo labels for namespace,
// service account, cluster and namespace labels. The pod's own labels under
// Cilium's prefix do not count: Cilium drops them, so that no pod owner
// can claim another service account or namespace.
type podLabelView struct {
	pod     *Pod
	ns      *Namespace
	cluster string
}

// Cilium's pseudo labels (pkg/k8s/apis/cilium.io), besides NamespaceLabel.
const (
	// Cilium drops a pod's own labels under this prefix, dot or not.
	ciliumLabelPrefix     = "io.cilium.k8s"
	serviceAccountLabel   = ciliumLabelPrefix + ".policy.serviceaccount"
	clusterLabel          = ciliumLabelPrefix + ".policy.cluster"
	namespaceLabelsPrefix = ciliumLabelPrefix + ".namespace.labels."
)

// legacyServiceAccountLabel is the service account label of other meshes'
// selectors. Cilium never sets it: a policy written with it selects by an
// ordinary pod label, as Cilium reads it too.
const legacyServiceAccountLabel = "io.kubernetes.pod.serviceaccount"

// labelNote says why no pod carries key in Cilium, or "".
func labelNote(key string) string {
	switch {
	case key == legacyServiceAccountLabel:
		return key + " is no label of Cilium's (the service account is " + serviceAccountLabel + ")"
	case key == serviceAccountLabel || key == clusterLabel || strings.HasPrefix(key, namespaceLabelsPrefix):
		return ""
	case strings.HasPrefix(key, ciliumLabelPrefix):
		return key + " is no label of Cilium's, and Cilium strips pods' own labels under " + ciliumLabelPrefix
	}
	return ""
}

func (v podLabelView) Lookup(key string) (string, bool) {
	switch {
	case key == NamespaceLabel:
		return v.pod.Namespace, true
	case key == serviceAccountLabel:
		// Cilium sets it only for a pod that names its service account.
		return v.pod.ServiceAccount, v.pod.ServiceAccount != ""
	case key == clusterLabel:
		return v.cluster, true
	case strings.HasPrefix(key, namespaceLabelsPrefix):
		if v.ns == nil {
			return "", false
		}
		return v.ns.Labels.Lookup(strings.TrimPrefix(key, namespaceLabelsPrefix))
	case strings.HasPrefix(key, ciliumLabelPrefix):
		return "", false
	}
	return v.pod.Labels.Lookup(key)
}

func (v podLabelView) Has(key string) bool {
	_, ok := v.Lookup(key)
	return ok
}

func (v podLabelView) Get(key string) string {
	val, _ := v.Lookup(key)
	return val
}

var (
	policyKeyIndex = statedb.Index[*Policy, string]{
		Name:       "name",
		FromObject: func(p *Policy) index.KeySet { return index.NewKeySet(index.String(p.Key())) },
		FromKey:    index.String,
		FromString: index.FromString,
		Unique:     true,
	}
	policyAnchorIndex = statedb.Index[*Policy, string]{
		Name: "anchor",
		FromObject: func(p *Policy) index.KeySet {
			if anchors := p.Anchors(); len(anchors) > 0 {
				return exactKeys(anchors)
			}
			return index.KeySet{}
		},
		FromKey:    ExactKey,
		FromString: ExactKeyFromString,
	}

	// PolicyByKey queries a policy by its key (see PolicyKey).
	PolicyByKey = policyKeyIndex.Query
	// PoliciesByAnchor queries the policies that may select pods carrying the
	// label LabelKey(k, v), or every pod (MatchAll).
	PoliciesByAnchor = policyAnchorIndex.Query
)

// NewPoliciesTable creates the policies table.
func NewPoliciesTable(db *statedb.DB) (statedb.RWTable[*Policy], error) {
	return statedb.NewTable(db, PoliciesTableName, policyKeyIndex, policyAnchorIndex)
}
