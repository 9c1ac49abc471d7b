// SPDX-License-Identifier: Apache-2.0

package tables

import (
	"encoding/json"
	"iter"
	"maps"
	"slices"
	"strings"

	"github.com/cilium/statedb/index"
	"github.com/cilium/statedb/reconciler"
)

// Labels and values that drive enrollment (CFP-32759 and Cilium's ztunnel
// mode), and mark the node's mTLS agent.
const (
	RedirTypeLabel    = "cilium.io/redir-type"
	RedirTypeWorkload = "workload" // enrolls the pod
	RedirTypeNone     = "none"     // opts the pod out
	RedirTypeProxy    = "proxy"    // marks the node's mTLS agent

	NamespaceEnabledLabel = "io.cilium/mtls-enabled"
)

// Labels are the labels of a Kubernetes object, sorted by key and stored flat
// as [key0, value0, key1, value1, ...]: a third of the memory of a small map,
// which matters at 100,000 pods. Never mutated once in a table.
type Labels []string

// NewLabels copies a label map.
func NewLabels(m map[string]string) Labels {
	if len(m) == 0 {
		return nil
	}
	l := make(Labels, 0, 2*len(m))
	for _, k := range slices.Sorted(maps.Keys(m)) {
		l = append(l, k, m[k])
	}
	return l
}

// Lookup returns the value of a label and whether it is set.
func (l Labels) Lookup(key string) (string, bool) {
	for i := 0; i+1 < len(l); i += 2 {
		if l[i] == key {
			return l[i+1], true
		}
	}
	return "", false
}

// Get returns the value of a label, "" when it is not set.
func (l Labels) Get(key string) string {
	v, _ := l.Lookup(key)
	return v
}

// All yields the labels in key order.
func (l Labels) All() iter.Seq2[string, string] {
	return func(yield func(string, string) bool) {
		for i := 0; i+1 < len(l); i += 2 {
			if !yield(l[i], l[i+1]) {
				return
			}
		}
	}
}

// Map returns the labels as a map.
func (l Labels) Map() map[string]string { return maps.Collect(l.All()) }

// String renders the labels as "app=web,tier=front".
func (l Labels) String() string {
	var b strings.Builder
	for k, v := range l.All() {
		if b.Len() > 0 {
			b.WriteByte(',')
		}
		b.WriteString(LabelKey(k, v))
	}
	return b.String()
}

// MarshalJSON writes the labels as a JSON object.
func (l Labels) MarshalJSON() ([]byte, error) { return json.Marshal(l.Map()) }

// UnmarshalJSON reads a JSON object.
func (l *Labels) UnmarshalJSON(b []byte) error {
	var m map[string]string
	if err := json.Unmarshal(b, &m); err != nil {
		return err
	}
	*l = NewLabels(m)
	return nil
}

// MarshalYAML writes the labels as a mapping (db/show --format=yaml).
func (l Labels) MarshalYAML() (any, error) { return l.Map(), nil }

// LabelKey is the index key of one label: "key=value".
func LabelKey(key, value string) string { return key + "=" + value }

// ExactKey is the key of a non-unique string index. statedb finds the
// objects of a non-unique key by a prefix search that skips longer keys; the
// terminator keeps "ns-1" from visiting "ns-10".."ns-199". "|" never occurs
// in Kubernetes names or labels.
func ExactKey(s string) index.Key { return index.String(s + "|") }

// ExactKeyFromString is ExactKey for script queries.
func ExactKeyFromString(s string) (index.Key, error) { return ExactKey(s), nil }

// exactKeys is ExactKey for several keys.
func exactKeys(ss []string) index.KeySet {
	keys := make([]index.Key, len(ss))
	for i, s := range ss {
		keys[i] = ExactKey(s)
	}
	return index.NewKeySet(keys[0], keys[1:]...)
}

// Dash shows an empty cell of a table row as "-".
func Dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// StatusString shows a reconcile status without its age, so that rows
// compare in scripts.
func StatusString(s reconciler.Status) string {
	if s.Kind == reconciler.StatusKindError {
		return "Error: " + s.GetError()
	}
	return s.Kind.String()
}
