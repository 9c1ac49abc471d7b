// SPDX-License-Identifier: Apache-2.0

package tables

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/selection"
)

// AuthenticationModeAnnotation on a CiliumNetworkPolicy or
// CiliumClusterwideNetworkPolicy carries the requirement of
// authentication.mode for every rule of the policy. Cilium v1.20 deprecated
// mutual authentication, and a schema without the field would have the API
// server prune it: the annotation survives that schema.
const AuthenticationModeAnnotation = "mtlsbridge.io/authentication-mode"

// Authentication modes Cilium accepts in a rule.
const (
	authModeDisabled       = "disabled"
	authModeRequired       = "required"
	authModeTestAlwaysFail = "test-always-fail"
)

// ParsePolicy reads a CiliumNetworkPolicy (kind KindCNP) or
// CiliumClusterwideNetworkPolicy (KindCCNP) given as its unstructured
// content. It never fails: a policy that cannot be understood comes back with
// its Error set, naming the field, so that the table shows why it enrolls
// nothing.
func ParsePolicy(kind PolicyKind, namespace, name string, content map[string]any) *Policy {
	p := &Policy{Kind: kind, Namespace: namespace, Name: name}
	if kind == KindCCNP {
		p.Namespace = ""
	}
	p.key = PolicyKey(kind, p.Namespace, name)
	sels, err := parsePolicy(content)
	if err != nil {
		p.Error = err.Error()
	}
	p.Selectors = sels
	return p
}

// errMalformed prefixes the errors of a policy whose shape is not Cilium's.
var errMalformed = errors.New("malformed policy")

// parsePolicy returns the selectors of the rules that require
// authentication. An error about the annotation comes with the selectors
// of the rules that require it themselves: Cilium enforces those whatever
// our annotation says. Any other error comes alone.
func parsePolicy(content map[string]any) ([]EndpointSelector, error) {
	allRequired := false
	var annotationErr error
	switch mode, set, _ := unstructured.NestedString(content, "metadata", "annotations", AuthenticationModeAnnotation); {
	case !set, mode == authModeDisabled:
	case mode == authModeRequired:
		allRequired = true
	default:
		annotationErr = fmt.Errorf("metadata.annotations[%s]: unknown mode %q (want %s or %s)",
			AuthenticationModeAnnotation, mode, authModeRequired, authModeDisabled)
	}

	type namedRule struct {
		path string
		rule map[string]any
	}
	var rules []namedRule
	if raw, ok := content["spec"]; ok && raw != nil {
		rule, ok := raw.(map[string]any)
		if !ok {
			return nil, shapeError("spec", "an object", raw)
		}
		rules = append(rules, namedRule{"spec", rule})
	}
	if raw, ok := content["specs"]; ok && raw != nil {
		list, ok := raw.([]any)
		if !ok {
			return nil, shapeError("specs", "a list", raw)
		}
		for i, item := range list {
			path := fmt.Sprintf("specs[%d]", i)
			rule, ok := item.(map[string]any)
			if !ok {
				return nil, shapeError(path, "an object", item)
			}
			rules = append(rules, namedRule{path, rule})
		}
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
		endpoints, err := labelSelector(nr.path+".endpointSelector", nr.rule["endpointSelector"])
		if err != nil {
			return nil, err
		}
		nodes, err := labelSelector(nr.path+".nodeSelector", nr.rule["nodeSelector"])
		if err != nil {
			return nil, err
		}
		switch {
		case endpoints == nil && nodes == nil:
			return nil, fmt.Errorf("%s: neither endpointSelector nor nodeSelector is set", nr.path)
		case endpoints == nil:
			// A node policy: it selects hosts, never pods.
			continue
		}
		sel, err := parseEndpointSelector(endpoints)
		if err != nil {
			return nil, fmt.Errorf("%s.endpointSelector: %w", nr.path, err)
		}
		if required || allRequired {
			sels = append(sels, sel)
		}
	}
	return sels, annotationErr
}

// labelSelector decodes a selector field; nil when it is absent.
func labelSelector(path string, raw any) (*metav1.LabelSelector, error) {
	if raw == nil {
		return nil, nil
	}
	m, ok := raw.(map[string]any)
	if !ok {
		return nil, shapeError(path, "an object", raw)
	}
	var ls metav1.LabelSelector
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(m, &ls); err != nil {
		return nil, fmt.Errorf("%w: %s: %v", errMalformed, path, err)
	}
	return &ls, nil
}

// requiresAuthentication reports whether any ingress or egress peer rule of
// the rule has authentication.mode "required".
func requiresAuthentication(path string, rule map[string]any) (bool, error) {
	required := false
	for _, dir := range []string{"ingress", "egress"} {
		raw, ok := rule[dir]
		if !ok || raw == nil {
			continue
		}
		peers, ok := raw.([]any)
		if !ok {
			return false, shapeError(path+"."+dir, "a list", raw)
		}
		for i, item := range peers {
			at := fmt.Sprintf("%s.%s[%d]", path, dir, i)
			peer, ok := item.(map[string]any)
			if !ok {
				return false, shapeError(at, "an object", item)
			}
			rawAuth, ok := peer["authentication"]
			if !ok || rawAuth == nil {
				continue
			}
			auth, ok := rawAuth.(map[string]any)
			if !ok {
				return false, shapeError(at+".authentication", "an object", rawAuth)
			}
			mode, ok := auth["mode"].(string)
			if !ok {
				return false, shapeError(at+".authentication.mode", "a string", auth["mode"])
			}
			switch mode {
			case authModeRequired:
				required = true
			case authModeDisabled, authModeTestAlwaysFail:
			default:
				return false, fmt.Errorf("%s.authentication.mode: unknown mode %q (want %s, %s or %s)",
					at, mode, authModeDisabled, authModeRequired, authModeTestAlwaysFail)
			}
		}
	}
	return required, nil
}

// shapeError names a field whose value has the wrong type (never its value:
// errors reach logs and tables).
func shapeError(path, want string, got any) error {
	kind := "null"
	switch got.(type) {
	case string:
		kind = "a string"
	case bool:
		kind = "a boolean"
	case int64, float64, int:
		kind = "a number"
	case []any:
		kind = "a list"
	case map[string]any:
		kind = "an object"
	}
	return fmt.Errorf("%w: %s: want %s, got %s", errMalformed, path, want, kind)
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
		key := strip(k)
		if old, dup := stripped.MatchLabels[key]; dup && old != v {
			// "k8s:app: a" and "app: b" ask one label for two values.
			selectsPods = false
		}
		stripped.MatchLabels[key] = v
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
	return EndpointSelector{Text: sel.String(), Note: selectorNote(sel), selector: sel, anchor: selectorAnchor(sel)}, nil
}

// selectorNote names the labels a selector requires that no pod carries
// in Cilium (see labelNote).
func selectorNote(sel labels.Selector) string {
	reqs, _ := sel.Requirements()
	var notes []string
	for _, r := range reqs {
		if r.Operator() == selection.DoesNotExist || r.Operator() == selection.NotEquals || r.Operator() == selection.NotIn {
			continue // holds for every pod: no surprise
		}
		if note := labelNote(r.Key()); note != "" && !slices.Contains(notes, note) {
			notes = append(notes, note)
		}
	}
	return strings.Join(notes, "; ")
}

// selectorAnchor picks one label every selected pod must carry, preferring
// the namespace pseudo label (usually the narrowest) over a pod label. The
// other pseudo labels (service account, cluster, namespace labels) never
// anchor: pods are looked up by their real labels and namespace.
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
		if strings.HasPrefix(key, ciliumLabelPrefix) {
			continue // a pseudo label, or one no pod carries
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
