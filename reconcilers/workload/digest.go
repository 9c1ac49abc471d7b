// SPDX-License-Identifier: Apache-2.0

package workload

import (
	"hash/maphash"
	"sync/atomic"

	"github.com/cilium/statedb"
	"google.golang.org/protobuf/encoding/protowire"
)

// Digest summarises a set of workloads independently of order: how many,
// and the sum of a term of each one's uid and version. A client that
// reconnects claiming exactly the table's workloads at their versions has
// the table's digest, so the xDS server can answer it without reading
// 100,000 claims one by one. A term is the hash of the claim as it is
// written in the request (the map entry of initial_resource_versions:
// name, then version), so that the server sums a request's entries
// without parsing them; a client that writes its entries otherwise only
// misses this shortcut.
type Digest struct {
	Count int
	Sum   uint64
}

// hashSeed is chosen once per process: digests and name hashes never
// leave it, and a client cannot aim collisions at a seed it does not know.
var hashSeed = maphash.MakeSeed()

// NameHash is the hash of a resource name, for lookups of claims by name.
func NameHash(name string) uint64 { return maphash.String(hashSeed, name) }

// EntryTerm is what one claim adds to a digest: the hash of its map entry
// (field 1 the name, field 2 the version, both length-delimited).
func EntryTerm(entry []byte) uint64 { return maphash.Bytes(hashSeed, entry) }

// term is EntryTerm of w's entry, written as a client writes it.
func term(w *Workload) uint64 {
	var buf [128]byte
	entry := protowire.AppendTag(buf[:0], 1, protowire.BytesType)
	entry = protowire.AppendString(entry, w.UID())
	entry = protowire.AppendTag(entry, 2, protowire.BytesType)
	entry = protowire.AppendString(entry, w.VersionString())
	return EntryTerm(entry)
}

// Add counts w in.
func (d *Digest) Add(w *Workload) {
	d.Count++
	d.Sum += term(w)
}

// Remove counts w out.
func (d *Digest) Remove(w *Workload) {
	d.Count--
	d.Sum -= term(w)
}

// Digests publishes the digest of the workloads table as of a revision of
// the table. The derivation, the table's only writer, publishes after each
// commit; a reader whose transaction shows that revision has the digest of
// what it reads.
type Digests struct {
	current atomic.Pointer[digestAt]
}

type digestAt struct {
	revision statedb.Revision
	Digest
}

// NewDigests returns Digests with none published yet.
func NewDigests() *Digests { return &Digests{} }

// Publish is for the table's writer: digest is the table's at revision.
func (d *Digests) Publish(revision statedb.Revision, digest Digest) {
	d.current.Store(&digestAt{revision, digest})
}

// At returns the digest of the workloads of txn, if it was published.
func (d *Digests) At(txn statedb.ReadTxn, workloads statedb.Table[*Workload]) (Digest, bool) {
	if d == nil {
		return Digest{}, false
	}
	cur := d.current.Load()
	if cur == nil || cur.revision != workloads.Revision(txn) {
		return Digest{}, false
	}
	return cur.Digest, true
}
