// SPDX-License-Identifier: Apache-2.0

package tables

import (
	"errors"
	"fmt"
	"strings"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/selection"
)

// The YAML shape of the fields of cilium.io/v2 policies that mtlsbridge
// reads. Everything else in a policy is ignored.
type (
	ciliumPolicy struct {
		Spec  *policyRule  `json:"spec,omitempty"`
		Specs []policyRule `json:"specs,omitempty"`
	}
	policyRule struct {
		EndpointSelector *metav1.LabelSelector `json:"endpointSelector,omitempty"`
		NodeSelector     *metav1.LabelSelector `json:"nodeSelector,omitempty"`
		Ingress          []peerRule            `json:"ingress,omitempty"`
		Egress           []peerRule            `json:"egress,omitempty"`
	}
	peerRule struct {
		Authentication *struct {
			Mode string `json:"mode"`
		} `json:"authentication,omitempty"`
	}
)

// Authentication modes Cilium accepts in a rule.
const (
	authModeDisabled       = "disabled"
	authModeRequired       = "required"
	authModeTestAlwaysFail = "test-always-fail"
)

// ParsePolicy reads a CiliumNetworkPolicy (kind KindCNP) or
// CiliumClusterwideNetworkPolicy (KindCCNP) given as its unstructured
// content. It never fails: a policy that cannot be understood comes back with
// its Error set, so that the table shows why it enrolls nothing.
func ParsePolicy(kind PolicyKind, namespace, name string, content map[string]any) *Policy {
	p := &Policy{Kind: kind, Namespace: namespace, Name: name}
	if kind == KindCCNP {
		p.Namespace = ""
	}
	sels, err := parsePolicy(content)
	if err != nil {
		p.Error = err.Error()
		return p
	}
	p.Selectors = sels
	return p
}

func parsePolicy(content map[string]any) ([]EndpointSelector, error) {
	var cp ciliumPolicy
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(content, &cp); err != nil {
		return nil, fmt.Errorf("malformed policy: %w", err)
	}
	type namedRule struct {
		path string
		rule policyRule
	}
	var rules []namedRule
	if cp.Spec != nil {
		rules = append(rules, namedRule{"spec", *cp.Spec})
	}
	for i, r := range cp.Specs {
		rules = append(rules, namedRule{fmt.Sprintf("specs[%d]", i), r})
	}
	if len(rules) == 0 {
		return nil, errors.New("policy has neither spec nor specs")
	}

	var sels []EndpointSelector
	for _, nr := range rules {
		required, err := requiresAuthentication(nr.path, nr.rule)
		if err != nil {
			return nil, err
		}
		switch {
		case nr.rule.EndpointSelector == nil && nr.rule.NodeSelector == nil:
			return nil, fmt.Errorf("%s: neither endpointSelector nor nodeSelector is set", nr.path)
		case nr.rule.EndpointSelector == nil:
			// A node policy: it selects hosts, never pods.
			continue
		}
		sel, err := parseEndpointSelector(nr.rule.EndpointSelector)
		if err != nil {
			return nil, fmt.Errorf("%s.endpointSelector: %w", nr.path, err)
		}
		if required {
			sels = append(sels, sel)
		}
	}
	return sels, nil
}

// requiresAuthentication reports whether any ingress or egress peer rule of
// the rule has authentication.mode "required".
func requiresAuthentication(path string, r policyRule) (bool, error) {
	required := false
	check := func(dir string, peers []peerRule) error {
		for i, peer := range peers {
			if peer.Authentication == nil {
				continue
			}
			switch mode := peer.Authentication.Mode; mode {
			case authModeRequired:
				required = true
			case authModeDisabled, authModeTestAlwaysFail:
			default:
				return fmt.Errorf("%s.%s[%d].authentication.mode: unknown mode %q (want %s, %s or %s)",
					path, dir, i, mode, authModeDisabled, authModeRequired, authModeTestAlwaysFail)
			}
		}
		return nil
	}
	if err := check("ingress", r.Ingress); err != nil {
		return false, err
	}
	return required, check("egress", r.Egress)
}

// parseEndpointSelector turns a Cilium endpointSelector into a Kubernetes
// label selector. Cilium writes keys with a source prefix ("k8s:app",
// "any:app"); both name a pod label. Other sources ("reserved:", "cidr:")
// never describe a pod, so such a selector selects nothing.
func parseEndpointSelector(ls *metav1.LabelSelector) (EndpointSelector, error) {
	stripped := &metav1.LabelSelector{MatchLabels: map[string]string{}}
	selectsPods := true
	strip := func(key string) string {
		src, rest, found := strings.Cut(key, ":")
		if !found {
			return key
		}
		if src != "k8s" && src != "any" {
			selectsPods = false
		}
		return rest
	}
	for k, v := range ls.MatchLabels {
		stripped.MatchLabels[strip(k)] = v
	}
	for _, e := range ls.MatchExpressions {
		e.Key = strip(e.Key)
		stripped.MatchExpressions = append(stripped.MatchExpressions, e)
	}
	sel, err := metav1.LabelSelectorAsSelector(stripped)
	if err != nil {
		return EndpointSelector{}, err
	}
	if !selectsPods {
		return EndpointSelector{Text: "<none: selects no pod>", selector: labels.Nothing(), anchor: LabelKey("<none>", "")}, nil
	}
	return EndpointSelector{Text: sel.String(), selector: sel, anchor: selectorAnchor(sel)}, nil
}

// selectorAnchor picks one label every selected pod must carry, preferring
// the namespace pseudo label (usually the narrowest) over a pod label. The
// other pseudo labels (service account, namespace labels) never anchor:
// pods are looked up by their real labels and namespace.
func selectorAnchor(sel labels.Selector) string {
	reqs, _ := sel.Requirements()
	anchor := ""
	for _, r := range reqs {
		var value string
		switch r.Operator() {
		case selection.Equals, selection.DoubleEquals, selection.In:
			if r.Values().Len() != 1 {
				continue
			}
			value = r.Values().UnsortedList()[0]
		default:
			continue
		}
		key := r.Key()
		if key == serviceAccountLabel || strings.HasPrefix(key, namespaceLabelsPrefix) {
			continue
		}
		if key == NamespaceLabel {
			return LabelKey(key, value)
		}
		if anchor == "" {
			anchor = LabelKey(key, value)
		}
	}
	return anchor
}
