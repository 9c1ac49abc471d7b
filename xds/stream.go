// SPDX-License-Identifier: Apache-2.0

package xds

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/cilium/statedb"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/mtlsbridge/mtlsbridge/internal/logthrottle"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/workload"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// typeState is what a stream knows of one resource type.
type typeState struct {
	subscribed bool
	wildcard   bool
	// names are the explicitly subscribed resource names (on-demand); an
	// alias ("network/ip") maps to the uid it resolved to.
	names map[string]string
	// held is what the client holds: resource name -> version (0 when the
	// client sent a version we do not recognise: always resent).
	held map[string]uint64
}

// interested reports whether the client wants a resource.
func (t *typeState) interested(uid string) bool {
	if t.wildcard {
		return true
	}
	for _, resolved := range t.names {
		if resolved == uid {
			return true
		}
	}
	return false
}

// stream is one delta ADS stream. Its loop owns all its state: requests
// and pushes are handled one at a time.
type stream struct {
	srv    *server
	grpc   discovery.AggregatedDiscoveryService_DeltaAggregatedResourcesServer
	ctx    context.Context
	client *Client
	types  map[string]*typeState
	nonce  uint64

	changes statedb.ChangeIterator[*workload.Workload]
	// sendq holds at most one response: a slow client stops the loop from
	// building more, and changes coalesce in the table meanwhile.
	sendq   chan *discovery.DeltaDiscoveryResponse
	sendErr chan error

	// txn is the snapshot the response being built reads from.
	txn statedb.ReadTxn
	// local are this node's workloads offered for the response being
	// built (uid: HBONE); pending, what each response in flight carried
	// of them, by nonce, until the client acknowledges it.
	local   map[string]bool
	pending map[uint64][]sentWorkload
	// alreadyHeld are this node's workloads the client holds at their
	// current version, found while building a response.
	alreadyHeld []sentWorkload

	// logs throttles the warnings a client can repeat at will.
	logs *logthrottle.Throttle
}

// sentWorkload is one of this node's workloads in a response.
type sentWorkload struct {
	uid     string
	hbone   bool
	removed bool
}

func (st *stream) run() error {
	ctx, cancel := context.WithCancel(st.ctx)
	defer cancel()
	st.ctx = ctx
	st.sendq = make(chan *discovery.DeltaDiscoveryResponse, 1)
	st.sendErr = make(chan error, 1)
	reqs := make(chan *discovery.DeltaDiscoveryRequest, 16)
	recvErr := make(chan error, 1)
	go func() {
		for {
			req, err := st.grpc.Recv()
			if err != nil {
				recvErr <- err
				return
			}
			select {
			case reqs <- req:
			case <-ctx.Done():
				return
			}
		}
	}()
	go func() {
		for {
			select {
			case resp := <-st.sendq:
				if err := st.grpc.Send(resp); err != nil {
					st.sendErr <- err
					return
				}
			case <-ctx.Done():
				return
			}
		}
	}()
	st.record(func(*Client) {})

	var (
		changed   <-chan struct{} // closes when the workloads table has news for us
		throttled <-chan time.Time
		lastPush  time.Time
	)
	for {
		select {
		case req := <-reqs:
			if err := st.handle(req); err != nil {
				return err
			}
			if changed == nil && st.changes != nil && throttled == nil {
				changed = closedChannel
			}
		case err := <-recvErr:
			return err
		case err := <-st.sendErr:
			return err
		case <-ctx.Done():
			return ctx.Err()
		case <-changed:
			changed = nil
			if wait := st.srv.Config.XDSCoalesce - time.Since(lastPush); wait > 0 {
				throttled = time.After(wait)
				continue
			}
			lastPush = time.Now()
			w, err := st.pushChanges()
			if err != nil {
				return err
			}
			changed = w
		case <-throttled:
			throttled = nil
			lastPush = time.Now()
			w, err := st.pushChanges()
			if err != nil {
				return err
			}
			changed = w
		}
	}
}

var closedChannel = func() <-chan struct{} { c := make(chan struct{}); close(c); return c }()

// handle processes one request: ACK/NACK bookkeeping and subscription
// changes, answering new subscriptions at once.
func (st *stream) handle(req *discovery.DeltaDiscoveryRequest) error {
	ts, known := st.types[req.GetTypeUrl()]
	if !known {
		st.srv.Metrics.UnknownTypes.Inc()
		if suppressed, ok := st.logs.Allow("unknown-type"); ok {
			st.srv.Log.Warn("xDS request for an unknown type ignored", "stream", st.client.ID,
				"type", truncate(req.GetTypeUrl(), 200), "suppressedSinceLast", suppressed)
		}
		return nil
	}
	// What a stream holds is bounded: a client subscribing to a million
	// names that do not exist must not keep them all.
	if held := len(ts.names) + len(req.GetResourceNamesSubscribe()) + len(req.GetInitialResourceVersions()); held > st.srv.Config.XDSMaxNames {
		st.srv.Metrics.Refused.WithLabelValues("too-many-names").Inc()
		return status.Errorf(codes.ResourceExhausted, "%s: the stream would hold %d resource names, more than --xds-max-names=%d",
			shortType(req.GetTypeUrl()), held, st.srv.Config.XDSMaxNames)
	}
	if nonce := req.GetResponseNonce(); nonce != "" {
		if detail := req.GetErrorDetail(); detail != nil {
			st.srv.Metrics.Nacks.WithLabelValues(shortType(req.GetTypeUrl())).Inc()
			if suppressed, ok := st.logs.Allow("nack"); ok {
				st.srv.Log.Warn("xDS response rejected", "stream", st.client.ID, "nonce", nonce,
					"error", truncate(detail.GetMessage(), 1000), "suppressedSinceLast", suppressed)
			}
			st.record(func(c *Client) {
				c.Nacks++
				c.LastNack = fmt.Sprintf("%s: %s", nonce, detail.GetMessage())
			})
		} else {
			st.record(func(c *Client) { c.LastAckNonce = nonce })
		}
		if req.GetTypeUrl() == AddressType {
			st.acknowledged(nonce, req.GetErrorDetail() == nil)
		}
	}

	first := !ts.subscribed
	if first {
		ts.subscribed = true
		ts.names = map[string]string{}
		ts.held = map[string]uint64{}
		// A first request with no names at all is a legacy wildcard.
		ts.wildcard = len(req.GetResourceNamesSubscribe()) == 0 && len(req.GetResourceNamesUnsubscribe()) == 0
		for name, v := range req.GetInitialResourceVersions() {
			version, _ := strconv.ParseUint(v, 16, 64)
			ts.held[name] = version
		}
		if id := req.GetNode().GetId(); id != "" {
			st.record(func(c *Client) { c.NodeID = id })
		}
	}
	var added []string
	for _, name := range req.GetResourceNamesSubscribe() {
		if name == "*" {
			ts.wildcard = true
		} else if _, ok := ts.names[name]; !ok {
			ts.names[name] = ""
			added = append(added, name)
		}
	}
	for _, name := range req.GetResourceNamesUnsubscribe() {
		if name == "*" {
			ts.wildcard = false
			continue
		}
		if uid := ts.names[name]; uid != "" {
			delete(ts.held, uid)
		}
		delete(ts.names, name)
		delete(ts.held, name)
	}
	st.record(func(c *Client) {
		if ts.wildcard {
			c.Subscriptions[req.GetTypeUrl()] = "*"
		} else {
			c.Subscriptions[req.GetTypeUrl()] = strconv.Itoa(len(ts.names))
		}
	})
	if !first && len(added) == 0 {
		return nil
	}
	if req.GetTypeUrl() == AuthorizationType {
		return st.answerAuthorization(ts, added)
	}
	return st.answerAddresses(ts, first, added)
}

// answerAuthorization: there are no Authorization resources yet (policy
// translation comes later); an empty answer is complete. Names the client
// holds or asks for do not exist.
func (st *stream) answerAuthorization(ts *typeState, added []string) error {
	removed := append(slicesOfKeys(ts.held), added...)
	clear(ts.held)
	return st.send(AuthorizationType, nil, removed)
}

// answerAddresses answers a new Address subscription: on the first
// request the whole current state (what the client does not already hold
// at the same version, and removal of what it holds that is gone); for
// names subscribed on demand, the workload they name.
func (st *stream) answerAddresses(ts *typeState, first bool, added []string) error {
	var resources []*discovery.Resource
	var removed []string
	var txn statedb.ReadTxn
	if first {
		// The snapshot is read after the iterator exists, so that no
		// deletion falls between the two.
		wtxn := st.srv.DB.WriteTxn(st.srv.Workloads)
		it, err := st.srv.Workloads.Changes(wtxn)
		txn = wtxn.Commit()
		if err != nil {
			return err
		}
		st.txn = txn
		st.changes = it
		// What the client says it holds and is gone must be removed.
		for name := range ts.held {
			if _, _, found := st.srv.Workloads.Get(txn, workload.ByUID(name)); !found {
				removed = append(removed, name)
				delete(ts.held, name)
			}
		}
		// The iterator's first batch is every workload: the snapshot.
		n := st.srv.Workloads.NumObjects(txn)
		if ts.wildcard && len(ts.held) < n {
			grown := make(map[string]uint64, n)
			maps.Copy(grown, ts.held)
			ts.held = grown
		}
		alloc := newResourceSlab(n)
		changes, _ := it.Next(txn)
		for c := range changes {
			if r := st.offerFrom(alloc, ts, c.Object); r != nil {
				resources = append(resources, r)
			}
		}
	} else {
		txn = st.srv.DB.ReadTxn()
		st.txn = txn
	}
	for _, name := range added {
		w := st.resolve(txn, name)
		if w == nil {
			removed = append(removed, name)
			continue
		}
		ts.names[name] = w.UID
		delete(ts.held, w.UID) // asked explicitly: always answer
		if r := st.offer(ts, w); r != nil {
			r.Aliases = []string{name}
			resources = append(resources, r)
		}
	}
	st.holds(st.alreadyHeld)
	st.alreadyHeld = nil
	return st.send(AddressType, resources, removed)
}

// resolve finds the workload an on-demand name means: a uid or "network/ip".
func (st *stream) resolve(txn statedb.ReadTxn, name string) *workload.Workload {
	if w, _, found := st.srv.Workloads.Get(txn, workload.ByUID(name)); found {
		return w
	}
	_, ipText, ok := strings.Cut(name, "/")
	if !ok {
		return nil
	}
	ip, err := tables.ParsePodAddr(ipText)
	if err != nil {
		return nil // "namespace/hostname": no services yet
	}
	var pods []string
	for pod := range st.srv.Pods.List(txn, tables.PodsByIP(ip)) {
		pods = append(pods, pod.Key())
	}
	// This node's pods may have addresses the API does not show yet.
	for row := range st.srv.CNIPods.List(txn, tables.CNIPodsByIP(ip)) {
		pods = append(pods, row.Pod)
	}
	for _, key := range pods {
		ns, name, _ := strings.Cut(key, "/")
		if w, _, found := st.srv.Workloads.Get(txn, workload.ByUID(workload.UID(st.srv.WorkloadConfig.ClusterID, ns, name))); found {
			return w
		}
	}
	return nil
}

// offer returns the resource to send for w, or nil when the client is not
// interested or already holds this version. It records what is sent.
func (st *stream) offer(ts *typeState, w *workload.Workload) *discovery.Resource {
	return st.offerFrom(newResourceSlab(1), ts, w)
}

func (st *stream) offerFrom(alloc *resourceSlab, ts *typeState, w *workload.Workload) *discovery.Resource {
	if !ts.interested(w.UID) {
		return nil
	}
	if v, ok := ts.held[w.UID]; ok && v == w.Version {
		// The client holds this very version (it said so when it
		// reconnected): it is acknowledged, though not sent again.
		if st.isLocal(w) {
			st.alreadyHeld = append(st.alreadyHeld, sentWorkload{uid: w.UID, hbone: w.HBONE})
		}
		return nil
	}
	ts.held[w.UID] = w.Version
	if st.isLocal(w) {
		if st.local == nil {
			st.local = map[string]bool{}
		}
		st.local[w.UID] = w.HBONE
	}
	r, a := alloc.next()
	r.Name, r.Version, r.Resource = w.UID, w.VersionString(), a
	a.TypeUrl, a.Value = AddressType, w.Resource
	return r
}

// resourceSlab allocates the resources of a large push in a few blocks
// rather than two allocations each.
type resourceSlab struct {
	resources []discovery.Resource
	anys      []anypb.Any
}

func newResourceSlab(n int) *resourceSlab {
	return &resourceSlab{resources: make([]discovery.Resource, 0, n), anys: make([]anypb.Any, 0, n)}
}

func (s *resourceSlab) next() (*discovery.Resource, *anypb.Any) {
	if len(s.resources) == cap(s.resources) {
		return &discovery.Resource{}, &anypb.Any{}
	}
	s.resources = s.resources[:len(s.resources)+1]
	s.anys = s.anys[:len(s.anys)+1]
	return &s.resources[len(s.resources)-1], &s.anys[len(s.anys)-1]
}

// pushChanges sends what changed in the workloads table since the last push.
func (st *stream) pushChanges() (<-chan struct{}, error) {
	ts := st.types[AddressType]
	st.txn = st.srv.DB.ReadTxn()
	changes, watch := st.changes.Next(st.txn)
	var resources []*discovery.Resource
	var removed []string
	for c := range changes {
		if c.Deleted {
			if _, held := ts.held[c.Object.UID]; held {
				delete(ts.held, c.Object.UID)
				removed = append(removed, c.Object.UID)
			}
			continue
		}
		if r := st.offer(ts, c.Object); r != nil {
			resources = append(resources, r)
		}
	}
	st.holds(st.alreadyHeld)
	st.alreadyHeld = nil
	if len(resources) == 0 && len(removed) == 0 {
		return watch, nil
	}
	return watch, st.send(AddressType, resources, removed)
}

// send queues responses of at most XDSMaxResourcesPerResponse resources
// (removals go with the first). An empty answer is still one response.
func (st *stream) send(typeURL string, resources []*discovery.Resource, removed []string) error {
	max := st.srv.Config.XDSMaxResourcesPerResponse
	for first := true; first || len(resources) > 0; first = false {
		n := min(len(resources), max)
		st.nonce++
		resp := &discovery.DeltaDiscoveryResponse{
			TypeUrl:   typeURL,
			Resources: resources[:n],
			Nonce:     strconv.FormatUint(st.nonce, 10),
		}
		if first {
			resp.RemovedResources = removed
		}
		st.track(st.nonce, resp)
		resources = resources[n:]
		timeout := time.NewTimer(st.srv.Config.XDSSendTimeout)
		select {
		case st.sendq <- resp:
			timeout.Stop()
		case err := <-st.sendErr:
			timeout.Stop()
			return err
		case <-st.ctx.Done():
			timeout.Stop()
			return st.ctx.Err()
		case <-timeout.C:
			return fmt.Errorf("client took no response for %s: closing the stream", st.srv.Config.XDSSendTimeout)
		}
		count := len(resp.Resources) + len(resp.RemovedResources)
		st.srv.Metrics.ResourcesSent.WithLabelValues(shortType(typeURL)).Add(float64(count))
		st.record(func(c *Client) { c.ResourcesSent += count })
	}
	return nil
}

// acknowledged settles the Address responses up to nonce: the client
// answers a type's responses in order, so older ones still pending were
// answered already or never will be. An ACK records this node's workloads
// the response carried.
func (st *stream) acknowledged(nonce string, ack bool) {
	n, err := strconv.ParseUint(nonce, 10, 64)
	if err != nil {
		return
	}
	if sent, ok := st.pending[n]; ok && ack {
		st.holds(sent)
	}
	for k := range st.pending {
		if k <= n {
			delete(st.pending, k)
		}
	}
}

// holds records what the client now holds of this node's workloads.
func (st *stream) holds(sent []sentWorkload) {
	if len(sent) == 0 {
		return
	}
	txn := st.srv.DB.WriteTxn(st.srv.Acks)
	for _, w := range sent {
		row := &Ack{Stream: st.client.ID, UID: w.uid, HBONE: w.hbone}
		if w.removed {
			st.srv.Acks.Delete(txn, row)
		} else {
			st.srv.Acks.Insert(txn, row)
		}
	}
	txn.Commit()
}

// isLocal reports whether w is the workload of a pod of this node.
func (st *stream) isLocal(w *workload.Workload) bool {
	if st.srv.Node.NodeName == "" || st.txn == nil {
		return false
	}
	_, key, ok := strings.Cut(w.UID, "//Pod/")
	if !ok {
		return false
	}
	pod, _, found := st.srv.Pods.Get(st.txn, tables.PodByKey(key))
	return found && pod.NodeName == st.srv.Node.NodeName
}

// track remembers what response nonce carries of this node's workloads.
func (st *stream) track(nonce uint64, resp *discovery.DeltaDiscoveryResponse) {
	if resp.TypeUrl != AddressType {
		return
	}
	var sent []sentWorkload
	for _, r := range resp.Resources {
		if hbone, ok := st.local[r.Name]; ok {
			sent = append(sent, sentWorkload{uid: r.Name, hbone: hbone})
			delete(st.local, r.Name)
		}
	}
	for _, uid := range resp.RemovedResources {
		sent = append(sent, sentWorkload{uid: uid, removed: true})
	}
	if len(sent) == 0 {
		return
	}
	if st.pending == nil {
		st.pending = map[uint64][]sentWorkload{}
	}
	// A client that never acknowledges must not grow this without end.
	if len(st.pending) >= maxPending {
		delete(st.pending, slices.Min(slices.Collect(maps.Keys(st.pending))))
	}
	st.pending[nonce] = sent
}

// maxPending bounds the responses a stream tracks until acknowledged.
const maxPending = 64

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n] + "..."
	}
	return s
}

// record updates the stream's xds-clients row.
func (st *stream) record(update func(*Client)) {
	c := *st.client
	c.Subscriptions = maps.Clone(st.client.Subscriptions)
	update(&c)
	st.client = &c
	txn := st.srv.DB.WriteTxn(st.srv.Clients)
	st.srv.Clients.Insert(txn, st.client)
	txn.Commit()
}

// forget removes the stream's row.
func (st *stream) forget() {
	txn := st.srv.DB.WriteTxn(st.srv.Clients, st.srv.Acks)
	st.srv.Clients.Delete(txn, st.client)
	for a := range st.srv.Acks.List(txn, AcksByStream(st.client.ID)) {
		st.srv.Acks.Delete(txn, a)
	}
	txn.Commit()
	if st.changes != nil {
		st.changes.Close()
	}
}

func slicesOfKeys(m map[string]uint64) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}
