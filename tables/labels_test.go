// SPDX-License-Identifier: Apache-2.0

package tables

import (
	"encoding/json"
	"maps"
	"testing"
)

func TestLabels(t *testing.T) {
	m := map[string]string{"tier": "front", "app": "web", "empty": "", "cilium.io/redir-type": "none"}
	l := NewLabels(m)
	if got := l.Map(); !maps.Equal(got, m) {
		t.Fatalf("Map() = %v, want %v", got, m)
	}
	for k, want := range m {
		if v, ok := l.Lookup(k); !ok || v != want {
			t.Errorf("Lookup(%q) = %q, %v; want %q, true", k, v, ok, want)
		}
	}
	// Keys sorting before, between and after the present ones.
	for _, k := range []string{"a", "b", "zz", "app2", "ap", ""} {
		if v, ok := l.Lookup(k); ok {
			t.Errorf("Lookup(%q) = %q, true; want not set", k, v)
		}
	}
	if got, want := l.String(), "app=web,cilium.io/redir-type=none,empty=,tier=front"; got != want {
		t.Errorf("String() = %q, want %q", got, want)
	}
	b, err := json.Marshal(l)
	if err != nil {
		t.Fatal(err)
	}
	var back Labels
	if err := json.Unmarshal(b, &back); err != nil || back != l {
		t.Errorf("JSON round trip: %v, %q; want %q", err, back.String(), l.String())
	}
	if !NewLabels(nil).IsZero() || l.IsZero() {
		t.Error("IsZero: want true for no labels only")
	}
}
