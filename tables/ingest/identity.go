// SPDX-License-Identifier: Apache-2.0

package ingest

import (
	"sync"

	"github.com/cilium/statedb"

	"github.com/mtlsbridge/mtlsbridge/tables"
)

// ciliumEndpoint is what mtlsbridge reads of a CiliumEndpoint: the Cilium
// security identity of the pod of the same namespace and name. It has no
// table: the identity is a column of the pod's row.
type ciliumEndpoint struct {
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	// Identity is 0 while Cilium has not allocated one.
	Identity uint32 `json:"identity,omitempty"`
}

// Key is "namespace/name", the key of its pod.
func (e *ciliumEndpoint) Key() string { return e.Namespace + "/" + e.Name }

// identities writes the identities of CiliumEndpoints into the rows of
// their pods: it is the sink of the CiliumEndpoints' reflection. Pods and
// CiliumEndpoints are watched apart, so an endpoint may come before its
// pod (at start, its listing before theirs) and outlive it: then its
// identity waits here, until the pod arrives or the endpoint goes. The
// identities held, in rows and waiting, are always those of the endpoints.
type identities struct {
	pods statedb.RWTable[*tables.Pod]

	mu      sync.Mutex
	waiting map[string]uint32 // by pod key, never 0
}

func newIdentities(pods statedb.RWTable[*tables.Pod]) *identities {
	return &identities{pods: pods, waiting: map[string]uint32{}}
}

// keep is how the pods' reflection writes a pod: with the identity its row
// holds, or the one waiting for it.
func (ids *identities) keep(old *tables.Pod, found bool, pod *tables.Pod) *tables.Pod {
	if found {
		pod.Identity = old.Identity
		return pod
	}
	ids.mu.Lock()
	defer ids.mu.Unlock()
	id, ok := ids.waiting[pod.Key()]
	if ok {
		pod.Identity = id
		delete(ids.waiting, pod.Key())
		if len(ids.waiting) == 0 {
			// A map keeps its size: the 100,000 endpoints listed before
			// their pods at start would hold 3.5 MB for good.
			ids.waiting = map[string]uint32{}
		}
	}
	return pod
}

// release keeps the identity of a pod whose row goes, until its endpoint
// goes too.
func (ids *identities) release(pod *tables.Pod) {
	if pod.Identity == 0 {
		return
	}
	ids.mu.Lock()
	defer ids.mu.Unlock()
	ids.waiting[pod.Key()] = pod.Identity
}

func (ids *identities) table() writableTable { return ids.pods }

// replace sets the identities of a full listing, and clears those of the
// pods whose endpoint it lacks. Its count is the endpoints with an identity.
func (ids *identities) replace(txn statedb.WriteTxn, listed []*ciliumEndpoint) int {
	want := make(map[string]uint32, len(listed))
	for _, ep := range listed {
		if ep.Identity != 0 {
			want[ep.Key()] = ep.Identity
		}
	}
	ids.mu.Lock()
	ids.waiting = map[string]uint32{} // not clear: it would keep the map's size
	ids.mu.Unlock()
	var gone []string // collected first: the table is not changed while iterated
	for pod := range ids.pods.All(txn) {
		if _, ok := want[pod.Key()]; !ok && pod.Identity != 0 {
			gone = append(gone, pod.Key())
		}
	}
	for _, key := range gone {
		ids.set(txn, key, 0)
	}
	for key, id := range want {
		ids.set(txn, key, id)
	}
	return len(want)
}

func (ids *identities) upsert(txn statedb.WriteTxn, ep *ciliumEndpoint) int {
	return ids.set(txn, ep.Key(), ep.Identity)
}

func (ids *identities) remove(txn statedb.WriteTxn, ep *ciliumEndpoint) int {
	return ids.set(txn, ep.Key(), 0)
}

// set gives the pod key the identity id (0: none), in its row or, while it
// has none, waiting for it. It returns the change of the count of
// endpoints with an identity.
func (ids *identities) set(txn statedb.WriteTxn, key string, id uint32) (delta int) {
	var had uint32
	if pod, _, found := ids.pods.Get(txn, tables.PodByKey(key)); found {
		had = pod.Identity
		if had != id {
			c := *pod
			c.Identity = id
			ids.pods.Insert(txn, &c)
		}
	} else {
		ids.mu.Lock()
		had = ids.waiting[key]
		if id != 0 {
			ids.waiting[key] = id
		} else {
			delete(ids.waiting, key)
		}
		ids.mu.Unlock()
	}
	switch {
	case had == 0 && id != 0:
		return 1
	case had != 0 && id == 0:
		return -1
	}
	return 0
}

// podSink writes the pods' rows with the identities of their endpoints:
// a new row takes the identity waiting for it, a row that goes leaves its
// identity waiting. An updated row keeps its shared text (keepSharedText).
func podSink(pods statedb.RWTable[*tables.Pod], ids *identities) tableSink[*tables.Pod] {
	merge := func(old *tables.Pod, found bool, pod *tables.Pod) *tables.Pod {
		if found {
			keepSharedText(old, pod)
		}
		return ids.keep(old, found, pod)
	}
	return tableSink[*tables.Pod]{pods, tables.SyncOptions[*tables.Pod]{Merge: merge, Gone: ids.release}}
}
