// SPDX-License-Identifier: Apache-2.0

package tables

import (
	"strconv"
	"strings"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
)

// SourcesTableName is the name of the table of object sources.
const SourcesTableName = "sources"

// Source is one origin of objects: a Kubernetes watch ("k8s/pods") or one
// file of the manifest folder ("file:pods.yaml"). It tells an operator where
// objects came from and what was wrong with them.
type Source struct {
	Name string `json:"name"`
	// Objects is how many objects the source holds right now.
	Objects int `json:"objects"`
	// Synced is true once the source has delivered its first full listing.
	Synced bool `json:"synced"`
	// Error is the last problem with the source or one of its objects, ""
	// when there is none.
	Error string `json:"error,omitempty"`
	// Duplicates names the objects of a manifest file that another file
	// (or the same) defines too, and which definition is used.
	Duplicates string `json:"duplicates,omitempty"`

	// Decoded are the objects a manifest file provided, kept so that a file
	// that stops parsing keeps its last good objects, and Documents the
	// number of the YAML document each came from. Not shown.
	Decoded   []any `json:"-"`
	Documents []int `json:"-"`
	// Digest identifies the file content Decoded came from. Not shown.
	Digest string `json:"-"`
}

func (s *Source) TableHeader() []string { return []string{"Name", "Objects", "Synced", "Error"} }

func (s *Source) TableRow() []string {
	problems := s.Error
	if s.Duplicates != "" {
		problems = strings.TrimPrefix(problems+"; "+s.Duplicates, "; ")
	}
	return []string{s.Name, strconv.Itoa(s.Objects), strconv.FormatBool(s.Synced), Dash(problems)}
}

var (
	sourceNameIndex = statedb.Index[*Source, string]{
		Name:       "name",
		FromObject: func(s *Source) index.KeySet { return index.NewKeySet(index.String(s.Name)) },
		FromKey:    index.String,
		FromString: index.FromString,
		Unique:     true,
	}

	// SourceByName queries a source by its name.
	SourceByName = sourceNameIndex.Query
)

// NewSourcesTable creates the sources table.
func NewSourcesTable(db *statedb.DB) (statedb.RWTable[*Source], error) {
	return statedb.NewTable(db, SourcesTableName, sourceNameIndex)
}
