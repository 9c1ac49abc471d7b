// SPDX-License-Identifier: Apache-2.0

package ingest

import (
	"fmt"
	"log/slog"
	"reflect"

	"github.com/cilium/statedb"

	"github.com/mtlsbridge/mtlsbridge/tables"
)

// writeTables are the tables the sources own.
type writeTables struct {
	DB         *statedb.DB
	log        *slog.Logger
	Pods       statedb.RWTable[*tables.Pod]
	Namespaces statedb.RWTable[*tables.Namespace]
	Policies   statedb.RWTable[*tables.Policy]
	Nodes      statedb.RWTable[*tables.Node]
	Sources    statedb.RWTable[*tables.Source]
}

func (w *writeTables) all() []statedb.TableMeta {
	return []statedb.TableMeta{w.Pods, w.Namespaces, w.Policies, w.Nodes, w.Sources}
}

// objectSet groups decoded objects by table, one per primary key: the
// first added wins.
type objectSet struct {
	pods       []*tables.Pod
	namespaces []*tables.Namespace
	policies   []*tables.Policy
	endpoints  []*ciliumEndpoint
	nodes      []*tables.Node
	// origins of the objects added, by describe(obj).
	origins map[string]origin
}

// origin is where an object was defined: a manifest file's sources row
// name and the number of the document in it.
type origin struct {
	file     string
	document int
}

// add adds obj unless an object of the same kind and key is already in the
// set; then it returns where that one came from, and dup.
func (s *objectSet) add(obj any, from origin) (winner origin, dup bool) {
	key := describe(obj)
	if winner, dup := s.origins[key]; dup {
		return winner, true
	}
	if s.origins == nil {
		s.origins = map[string]origin{}
	}
	s.origins[key] = from
	switch o := obj.(type) {
	case *tables.Pod:
		s.pods = append(s.pods, o)
	case *tables.Namespace:
		s.namespaces = append(s.namespaces, o)
	case *tables.Policy:
		s.policies = append(s.policies, o)
	case *ciliumEndpoint:
		s.endpoints = append(s.endpoints, o)
	case *tables.Node:
		s.nodes = append(s.nodes, o)
	}
	return origin{}, false
}

// describe names an object by its kind and table key, e.g. "pod app/web".
func describe(obj any) string {
	switch o := obj.(type) {
	case *tables.Pod:
		return "pod " + o.Key()
	case *tables.Namespace:
		return "namespace " + o.Name
	case *tables.Policy:
		return "policy " + o.Key()
	case *ciliumEndpoint:
		return "ciliumendpoint " + o.Key()
	case *tables.Node:
		return "node " + o.Name
	}
	return fmt.Sprintf("%T", obj)
}

// replaceAll makes every table hold exactly the objects of the set, each
// pod with the identity of its CiliumEndpoint.
func (w *writeTables) replaceAll(txn statedb.WriteTxn, s *objectSet) {
	identities := make(map[string]uint32, len(s.endpoints))
	for _, ep := range s.endpoints {
		identities[ep.Key()] = ep.Identity
	}
	pods := make([]*tables.Pod, len(s.pods))
	for i, pod := range s.pods {
		// A copy: the decoded pod is shared with its file's sources row.
		if id := identities[pod.Key()]; id != pod.Identity {
			c := *pod
			c.Identity = id
			pod = &c
		}
		pods[i] = pod
	}
	tables.Sync(txn, w.Pods, pods, tables.SyncOptions[*tables.Pod]{})
	tables.Sync(txn, w.Namespaces, s.namespaces, tables.SyncOptions[*tables.Namespace]{})
	tables.Sync(txn, w.Policies, s.policies, tables.SyncOptions[*tables.Policy]{Merge: keepLastValid(w.log)})
	tables.Sync(txn, w.Nodes, s.nodes, tables.SyncOptions[*tables.Node]{})
}

// sink is where a Kubernetes reflection writes what it reads. Each method
// returns by how much the count of the source's objects changes.
type sink[T any] interface {
	// table is the table written, locked for each batch.
	table() writableTable
	// replace makes the table hold what a full listing says.
	replace(txn statedb.WriteTxn, listed []T) (objects int)
	upsert(txn statedb.WriteTxn, obj T) (delta int)
	remove(txn statedb.WriteTxn, obj T) (delta int)
}

// writableTable is a table a source writes and marks initialized.
type writableTable interface {
	statedb.TableMeta
	RegisterInitializer(txn statedb.WriteTxn, name string) func(statedb.WriteTxn)
}

// tableSink writes objects as the rows of a table, keyed as the table is.
type tableSink[T any] struct {
	tbl  statedb.RWTable[T]
	opts tables.SyncOptions[T]
}

func (s tableSink[T]) table() writableTable { return s.tbl }

func (s tableSink[T]) replace(txn statedb.WriteTxn, listed []T) int {
	return tables.Sync(txn, s.tbl, listed, s.opts)
}

// upsert inserts obj unless an equal row is already there, so that
// consumers of the table's changes see only real changes.
func (s tableSink[T]) upsert(txn statedb.WriteTxn, obj T) int {
	q, _ := s.tbl.PrimaryIndexer().QueryFromObject(obj)
	old, _, found := s.tbl.Get(txn, q)
	if s.opts.Merge != nil {
		obj = s.opts.Merge(old, found, obj)
	}
	if found && reflect.DeepEqual(old, obj) {
		return 0
	}
	s.tbl.Insert(txn, obj)
	if found {
		return 0
	}
	return 1
}

// remove deletes the row with obj's primary key.
func (s tableSink[T]) remove(txn statedb.WriteTxn, obj T) int {
	old, hadOld, _ := s.tbl.Delete(txn, obj)
	if !hadOld {
		return 0
	}
	if s.opts.Gone != nil {
		s.opts.Gone(old)
	}
	return -1
}

// keepLastValid is how a new version of a policy is written: an invalid
// version keeps enrolling what the last valid one selected (the error in
// its row), so that an edit that breaks a policy never silently unenrolls
// the pods it protects. Each version that becomes invalid, or valid
// again, is logged.
func keepLastValid(log *slog.Logger) func(old *tables.Policy, found bool, new *tables.Policy) *tables.Policy {
	return func(old *tables.Policy, found bool, new *tables.Policy) *tables.Policy {
		if !found {
			old = nil
		}
		p := tables.KeepLastValid(old, new)
		switch {
		case p.Error != "" && (old == nil || old.Error != p.Error):
			switch {
			case p.LastValid():
				log.Warn("Invalid policy version: still enrolling what its last valid version selected", "policy", p.Key(), "error", p.Error)
			case p.RequiresAuthentication():
				log.Warn("Invalid policy: its rules that require authentication still enroll", "policy", p.Key(), "error", p.Error)
			default:
				log.Warn("Invalid policy: it enrolls nothing", "policy", p.Key(), "error", p.Error)
			}
		case p.Error == "" && old != nil && old.Error != "":
			log.Info("Policy valid again", "policy", p.Key())
		}
		return p
	}
}
