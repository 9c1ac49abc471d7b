// SPDX-License-Identifier: Apache-2.0

package tables_test

import (
	"slices"
	"testing"

	"github.com/mtlsbridge/mtlsbridge/tables"
)

// TestKeepLastValid: an invalid version enrolls what the last valid
// version selected, besides its own selectors; invalid versions in between
// add nothing, and a valid version is taken as it is.
func TestKeepLastValid(t *testing.T) {
	version := func(errText string, texts ...string) *tables.Policy {
		p := &tables.Policy{Kind: tables.KindCNP, Namespace: "app", Name: "p", Error: errText}
		for _, text := range texts {
			p.Selectors = append(p.Selectors, tables.EndpointSelector{Text: text})
		}
		return p
	}
	texts := func(p *tables.Policy) []string {
		var out []string
		for _, s := range p.Selectors {
			out = append(out, s.Text)
		}
		return out
	}
	steps := []struct {
		name      string
		version   *tables.Policy
		want      []string
		lastValid bool
	}{
		{"valid", version("", "app=a"), []string{"app=a"}, false},
		{"invalid, selecting b itself", version("bad annotation", "app=b"), []string{"app=a", "app=b"}, true},
		{"invalid again, selecting c itself", version("bad annotation", "app=c"), []string{"app=a", "app=c"}, true},
		{"invalid, selecting a itself", version("bad annotation", "app=a"), []string{"app=a"}, true},
		{"valid again", version("", "app=d"), []string{"app=d"}, false},
		{"invalid, selecting nothing", version("bad selector"), []string{"app=d"}, true},
	}
	var current *tables.Policy
	for _, step := range steps {
		current = tables.KeepLastValid(current, step.version)
		if got := texts(current); !slices.Equal(got, step.want) || current.LastValid() != step.lastValid {
			t.Fatalf("%s: selectors %v, last valid %v; want %v, %v", step.name, got, current.LastValid(), step.want, step.lastValid)
		}
	}
	if first := tables.KeepLastValid(nil, version("bad selector")); first.LastValid() || len(first.Selectors) != 0 {
		t.Errorf("invalid from the start: %v, want it to enroll nothing", texts(first))
	}
}
