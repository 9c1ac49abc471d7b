// SPDX-License-Identifier: Apache-2.0

package tables

import (
	"encoding/json"
	"iter"
	"maps"
	"slices"
	"strings"
	"unique"

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

// Labels are the labels of a Kubernetes object, sorted by key and stored as
// one string "key0\x00value0\x00key1\x00value1...": one allocation a pod
// where a slice of strings takes three, and a map more, which matters at
// 100,000 pods. Kubernetes label keys and values never hold a NUL.
type Labels struct {
	flat string
}

// labelSep separates the keys and values of Labels.
const labelSep = "\x00"

// NewLabels copies a label map.
func NewLabels(m map[string]string) Labels {
	if len(m) == 0 {
		return Labels{}
	}
	keys := slices.Sorted(maps.Keys(m))
	size := 2*len(keys) - 1 // the separators
	for _, k := range keys {
		size += len(k) + len(m[k])
	}
	var b strings.Builder
	b.Grow(size) // exactly: a builder left to grow holds up to twice the bytes
	for _, k := range keys {
		if b.Len() > 0 {
			b.WriteString(labelSep)
		}
		b.WriteString(k)
		b.WriteString(labelSep)
		b.WriteString(m[k])
	}
	return Labels{flat: b.String()}
}

// Interned returns labels whose text is the one copy that equal labels
// share (see the conversion of pods: replicas have equal labels).
func (l Labels) Interned() Labels { return Labels{flat: unique.Make(l.flat).Value()} }

// Lookup returns the value of a label and whether it is set.
func (l Labels) Lookup(key string) (string, bool) {
	for rest := l.flat; rest != ""; {
		k, afterKey, _ := strings.Cut(rest, labelSep)
		if k == key {
			v, _, _ := strings.Cut(afterKey, labelSep)
			return v, true
		}
		if k > key { // sorted: key is not further on
			break
		}
		_, rest, _ = strings.Cut(afterKey, labelSep)
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
		rest := l.flat
		for rest != "" {
			k, afterKey, _ := strings.Cut(rest, labelSep)
			v, afterValue, _ := strings.Cut(afterKey, labelSep)
			if !yield(k, v) {
				return
			}
			rest = afterValue
		}
	}
}

// IsZero reports whether there are no labels (json omitzero).
func (l Labels) IsZero() bool { return l.flat == "" }

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
