// SPDX-License-Identifier: Apache-2.0

package workload

import (
	"sync/atomic"

	"github.com/cespare/xxhash/v2"
	"github.com/cilium/statedb"
)

// Digest summarises a set of workloads independently of order: how many,
// and the sum of a term of each one's uid and version. A client that
// reconnects claiming exactly the table's workloads at their versions has
// the table's digest, so the xDS server can answer it without comparing
// 100,000 claims one by one (a probe of a large map for each costs
// hundreds of nanoseconds of memory latency).
type Digest struct {
	Count int
	Sum   uint64
}

// NameHash is the hash of a resource name in digests.
func NameHash(name string) uint64 { return xxhash.Sum64String(name) }

// DigestTerm is what a resource (its name's hash and its version) adds to
// a digest: the two mixed (splitmix64's finalizer), so that sums of
// different sets differ.
func DigestTerm(nameHash, version uint64) uint64 {
	z := nameHash ^ (version * 0x9e3779b97f4a7c15)
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

// Add counts w in.
func (d *Digest) Add(w *Workload) {
	d.Count++
	d.Sum += DigestTerm(NameHash(w.UID), w.Version)
}

// Remove counts w out.
func (d *Digest) Remove(w *Workload) {
	d.Count--
	d.Sum -= DigestTerm(NameHash(w.UID), w.Version)
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
