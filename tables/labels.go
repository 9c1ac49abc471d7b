// SPDX-License-Identifier: Apache-2.0

package tables

import (
	"maps"
	"slices"
	"strings"
)

// Labels are the labels of a Kubernetes object. Never mutated once the
// object is in a table.
type Labels map[string]string

// String renders the labels sorted by key, e.g. "app=web,tier=front", so that
// table rows are deterministic.
func (l Labels) String() string {
	if len(l) == 0 {
		return ""
	}
	var b strings.Builder
	for i, k := range slices.Sorted(maps.Keys(l)) {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(k)
		b.WriteByte('=')
		b.WriteString(l[k])
	}
	return b.String()
}

// keys returns "key=value" for every label, the form the label indexes use.
func (l Labels) keys() []string {
	out := make([]string, 0, len(l))
	for k, v := range l {
		out = append(out, LabelKey(k, v))
	}
	return out
}

// LabelKey is the index key of one label: "key=value".
func LabelKey(key, value string) string { return key + "=" + value }

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
