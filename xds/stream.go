// SPDX-License-Identifier: Apache-2.0

package xds

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"runtime"
	"runtime/trace"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/cilium/statedb"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/mtlsbridge/mtlsbridge/grpcserver"
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
	// resolved counts the names resolved to each uid.
	resolved map[string]int
	// awaited are the "network/ip" names answered as removed (no workload
	// had the address), by address: the workload that takes it later is
	// pushed under the name.
	awaited map[netip.Addr][]string
	// held is what the client holds: resource name -> version (0 when the
	// client sent a version we do not recognise: always resent). A
	// wildcard Address stream keeps no such map once answered: its client
	// holds exactly the workloads of the stream's view (stream.view), so
	// that a client costs the server nothing per workload.
	held map[string]uint64
	// claims are the first request's initial_resource_versions, until the
	// first answer compares them with the table.
	claims claims
}

// interested reports whether the client wants a resource: by wildcard,
// by a name resolved to it, or by its uid subscribed before it existed.
func (t *typeState) interested(uid string) bool {
	if t.wildcard || t.resolved[uid] > 0 {
		return true
	}
	_, named := t.names[uid]
	return named
}

// resolve records that name means uid.
func (t *typeState) resolve(name, uid string) {
	t.drop(name)
	t.names[name] = uid
	t.resolved[uid]++
}

// drop forgets name.
func (t *typeState) drop(name string) {
	if uid := t.names[name]; uid != "" {
		if t.resolved[uid]--; t.resolved[uid] <= 0 {
			delete(t.resolved, uid)
		}
	}
	delete(t.names, name)
	if ip, ok := aliasAddr(name); ok && len(t.awaited[ip]) > 0 {
		if t.awaited[ip] = slices.DeleteFunc(t.awaited[ip], func(n string) bool { return n == name }); len(t.awaited[ip]) == 0 {
			delete(t.awaited, ip)
		}
	}
}

// await records that name, an address no workload has, was answered as
// removed.
func (t *typeState) await(name string) {
	ip, ok := aliasAddr(name)
	if !ok || slices.Contains(t.awaited[ip], name) {
		return
	}
	if t.awaited == nil {
		t.awaited = map[netip.Addr][]string{}
	}
	t.awaited[ip] = append(t.awaited[ip], name)
}

// unresolve returns the names resolved to uid, a workload that is gone,
// other than uid itself, and marks them unresolved: the client keeps them
// subscribed.
func (t *typeState) unresolve(uid string) []string {
	if t.resolved[uid] == 0 {
		return nil
	}
	var names []string
	for name, to := range t.names {
		if to == uid && name != uid {
			names = append(names, name)
		}
	}
	for _, name := range names {
		t.drop(name)
		t.names[name] = ""
	}
	return names
}

// aliasAddr is the address of an on-demand "network/ip" name.
func aliasAddr(name string) (netip.Addr, bool) {
	_, ipText, ok := strings.Cut(name, "/")
	if !ok {
		return netip.Addr{}, false
	}
	ip, err := tables.ParsePodAddr(ipText)
	return ip, err == nil
}

// stream is one delta ADS stream. Its loop owns all its state: requests
// and pushes are handled one at a time.
type stream struct {
	srv    *server
	grpc   deltaStream
	ctx    context.Context
	client *Client
	caller grpcserver.Caller
	types  map[string]*typeState
	nonce  uint64

	changes statedb.ChangeIterator[*workload.Workload]
	// view is the snapshot of the workloads table that the last Address
	// answer or push read: a wildcard client holds its workloads.
	view statedb.ReadTxn
	// sendq holds at most one response: a slow client stops the loop from
	// building more, and changes coalesce in the table meanwhile.
	sendq   chan wireResponse
	sendErr chan error

	// local tells this node's workloads apart in the response being
	// built; localHBONE are those offered (uid: HBONE); pending, what each
	// response in flight carried of them, by nonce, until the client
	// acknowledges it.
	local      func(*workload.Workload) bool
	localHBONE map[string]bool
	pending    map[uint64][]sentWorkload
	// pendingWorkloads counts the entries of pending's lists.
	pendingWorkloads int
	// alreadyHeld are this node's workloads the client holds at their
	// current version, found while building a response.
	alreadyHeld []sentWorkload

	// logs throttles the warnings a client can repeat at will.
	logs *logthrottle.Throttle
	// dirty: client has changes its row does not show yet.
	dirty bool
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
	st.sendq = make(chan wireResponse, 1)
	st.sendErr = make(chan error, 1)
	// Unbuffered: a request waits decoded in the receiving goroutine only,
	// so that a client whose responses wait (up to --xds-send-timeout)
	// holds one request of --grpc-max-message-bytes here, not a queue.
	reqs := make(chan request)
	recvErr := make(chan error, 1)
	go func() {
		for {
			req, err := recv(st.grpc, st.srv.Config.XDSMaxNames)
			if errors.Is(err, errMalformedRequest) {
				err = status.Error(codes.InvalidArgument, err.Error())
			}
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
				region := trace.StartRegion(ctx, "xds send")
				err := st.grpc.SendMsg(resp)
				region.End()
				if err != nil {
					st.sendErr <- err
					return
				}
			case <-ctx.Done():
				return
			}
		}
	}()
	st.dirty = true
	st.flush()

	var (
		changed   <-chan struct{} // closes when the workloads table has news for us
		throttled <-chan time.Time
		lastPush  time.Time
		// callerChanged closes when the caller's pod row changes: the
		// stream serves only while the caller is this node's agent.
		callerChanged <-chan struct{}
	)
	if st.srv.Auth != nil {
		var err error
		if callerChanged, err = st.srv.Auth.Allowed(st.srv.DB.ReadTxn(), st.caller); err != nil {
			return err
		}
	}
	for {
		select {
		case <-callerChanged:
			var err error
			if callerChanged, err = st.srv.Auth.Allowed(st.srv.DB.ReadTxn(), st.caller); err != nil {
				st.srv.Log.Warn("xDS stream closed: its caller is no longer this node's mTLS agent", "stream", st.client.ID, "pod", st.client.Pod, "error", err)
				return err
			}
		case req := <-reqs:
			err := st.handle(req)
			st.flush()
			if err != nil {
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
func (st *stream) handle(req request) error {
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
	// names that do not exist must not keep them all. Names it holds
	// already do not count again (a client may repeat its subscriptions);
	// a name repeated within the request does.
	newNames := 0
	for _, name := range req.GetResourceNamesSubscribe() {
		if len(name) > maxNameBytes {
			st.srv.Metrics.Refused.WithLabelValues("name-too-long").Inc()
			return status.Errorf(codes.ResourceExhausted, "%s: a resource name of %d bytes, more than %d",
				shortType(req.GetTypeUrl()), len(name), maxNameBytes)
		}
		if _, held := ts.names[name]; !held {
			newNames++
		}
	}
	if held := len(ts.names) + newNames + req.initial.count(); held > st.srv.Config.XDSMaxNames {
		st.srv.Metrics.Refused.WithLabelValues("too-many-names").Inc()
		return status.Errorf(codes.ResourceExhausted, "%s: the stream would hold %d resource names, more than --xds-max-names=%d",
			shortType(req.GetTypeUrl()), held, st.srv.Config.XDSMaxNames)
	}
	if nonce := req.GetResponseNonce(); nonce != "" {
		if detail := req.GetErrorDetail(); detail != nil {
			st.srv.Metrics.Nacks.WithLabelValues(shortType(req.GetTypeUrl())).Inc()
			if suppressed, ok := st.logs.Allow("nack"); ok {
				st.srv.Log.Warn("xDS response rejected", "stream", st.client.ID, "nonce", truncate(nonce, 100),
					"error", truncate(detail.GetMessage(), 1000), "suppressedSinceLast", suppressed)
			}
			st.record(func(c *Client) {
				c.Nacks++
				c.LastNack = truncate(fmt.Sprintf("%s: %s", nonce, detail.GetMessage()), 1000)
			})
		} else {
			st.record(func(c *Client) { c.LastAckNonce = truncate(nonce, 100) })
		}
		if req.GetTypeUrl() == AddressType {
			st.acknowledged(nonce, req.GetErrorDetail() == nil)
		}
	}

	first := !ts.subscribed
	wasWildcard := ts.wildcard
	if first {
		ts.subscribed = true
		ts.names, ts.resolved = map[string]string{}, map[string]int{}
		ts.held, ts.claims = map[string]uint64{}, req.initial
		// A first request with no names at all is a legacy wildcard.
		ts.wildcard = len(req.GetResourceNamesSubscribe()) == 0 && len(req.GetResourceNamesUnsubscribe()) == 0
		if id := req.GetNode().GetId(); id != "" {
			st.record(func(c *Client) { c.NodeID = truncate(id, 1000) })
		}
	}
	// Every name subscribed is answered, also one subscribed already: the
	// client may have forgotten it (xDS "Subscribing to Resources"), and
	// ztunnel's on-demand lookups wait for the answer.
	var added []string
	for _, name := range req.GetResourceNamesSubscribe() {
		if name == "*" {
			ts.wildcard = true
			continue
		}
		if _, ok := ts.names[name]; !ok {
			ts.names[name] = ""
		}
		added = append(added, name)
	}
	if len(added) > 1 {
		slices.Sort(added)
		added = slices.Compact(added)
	}
	for _, name := range req.GetResourceNamesUnsubscribe() {
		if name == "*" {
			if wasWildcard && ts.wildcard {
				// Leaving wildcard: from now on what it holds is listed
				// (before the names this request drops are dropped).
				st.materializeHeld(ts)
			}
			ts.wildcard = false
			continue
		}
		uid := cmp.Or(ts.names[name], name)
		ts.drop(name)
		// Held as long as another name still wants it.
		if !ts.interested(uid) {
			delete(ts.held, uid)
		}
	}
	subscription := "*"
	if !ts.wildcard {
		subscription = strconv.Itoa(len(ts.names))
	}
	if st.client.Subscriptions[req.GetTypeUrl()] != subscription {
		st.record(func(c *Client) { c.Subscriptions[req.GetTypeUrl()] = subscription })
	}
	// The row shows what the client asked for before the answer leaves:
	// a client that has its answer finds itself in xds-clients.
	st.flush()
	if req.GetTypeUrl() == AuthorizationType {
		if !first && len(added) == 0 {
			return nil
		}
		return st.answerAuthorization(ts, added)
	}
	if !first && !wasWildcard && ts.wildcard {
		// The client now wants everything: what it lacks goes now.
		return st.answerAddresses(ts, true, added)
	}
	if !first && len(added) == 0 {
		return nil
	}
	return st.answerAddresses(ts, first, added)
}

// answerAuthorization: there are no Authorization resources yet (policy
// translation comes later); an empty answer is complete. Names the client
// holds or asks for do not exist.
func (st *stream) answerAuthorization(ts *typeState, added []string) error {
	if err := ts.claims.read(); err != nil {
		return err
	}
	removed := append(append(slicesOfKeys(ts.held), ts.claims.names...), added...)
	clear(ts.held)
	ts.claims = claims{}
	return st.send(AuthorizationType, nil, removed)
}

// answerAddresses answers an Address subscription. With snapshot (the
// first request, or wildcard subscribed later) it sends the whole current
// state the client wants and does not already hold at the same version,
// and removes what it holds that is gone; then, for names subscribed on
// demand, the workload each names.
func (st *stream) answerAddresses(ts *typeState, snapshot bool, added []string) error {
	answer := st.respond(AddressType)
	var removed []string
	var txn statedb.ReadTxn
	switch {
	case st.changes == nil:
		// The snapshot is read after the iterator exists, so that no
		// deletion falls between the two; the iterator's first batch is
		// every workload: the snapshot.
		wtxn := st.srv.DB.WriteTxn(st.srv.Workloads)
		it, err := st.srv.Workloads.Changes(wtxn)
		txn = wtxn.Commit()
		if err != nil {
			return err
		}
		st.changes = it
		changes, _ := it.Next(txn)
		if st.holdsExactly(ts, txn) {
			// Nothing to compare, nothing to send: the iterator's first
			// batch (the whole table) is passed once answered. The
			// sender, readied by the answer, goes first: it would
			// otherwise wait for these milliseconds of passing whenever
			// the other processors are busy.
			defer func() {
				runtime.Gosched()
				for range changes {
				}
			}()
			break
		}
		if err := ts.claims.read(); err != nil {
			return err
		}
		if !ts.wildcard {
			st.subscribeClaims(ts, txn)
			subscribed := strconv.Itoa(len(ts.names))
			st.record(func(c *Client) { c.Subscriptions[AddressType] = subscribed })
		}
		removed, err = st.snapshot(ts, txn, ts.claims, true, askedByUID(added), func(yield func(*workload.Workload) bool) {
			for c := range changes {
				if !yield(c.Object) {
					return
				}
			}
		}, answer)
		if err != nil {
			return err
		}
	case snapshot:
		// Wildcard subscribed on a stream already answered: later pushes
		// compare against this view, so changes the iterator has not
		// reported yet are not sent twice.
		txn = st.srv.DB.ReadTxn()
		var err error
		removed, err = st.snapshot(ts, txn, claimsOf(ts.held), false, askedByUID(added), func(yield func(*workload.Workload) bool) {
			for w := range st.srv.Workloads.All(txn) {
				if !yield(w) {
					return
				}
			}
		}, answer)
		if err != nil {
			return err
		}
	default:
		txn = st.srv.DB.ReadTxn()
		if ts.wildcard {
			// The names answered below come from txn: catch up on the
			// rest of it too, so that the client holds exactly one view.
			var out []outgoing
			out, removed = st.changesSince(ts, txn)
			for _, o := range out {
				if err := answer.add(o); err != nil {
					return err
				}
			}
		}
	}
	if ts.wildcard {
		st.view = txn
	}
	st.local = st.localIn(txn, false)
	for _, name := range added {
		w := st.resolve(txn, name)
		if w == nil {
			removed = append(removed, name)
			ts.await(name)
			continue
		}
		ts.resolve(name, w.UID())
		// Asked explicitly: always answered, even when held.
		st.sending(ts, w)
		if err := answer.add(outgoing{w: w, alias: name}); err != nil {
			return err
		}
	}
	st.holds(st.alreadyHeld)
	st.alreadyHeld = nil
	return answer.finish(removed)
}

// snapshot compares the workloads of txn with what the client holds
// (claimed): it adds what to send to answer as it goes, and returns the
// held names that no longer exist. A wildcard client then holds txn's
// view (ts.held goes); an on-demand one keeps the list. Claims the client
// made itself (its initial_resource_versions, not what was sent and may be
// unacknowledged) are recorded as acknowledged. Workloads asked for by
// their uid in the same request are left to that request's answer, which
// sends them once.
func (st *stream) snapshot(ts *typeState, txn statedb.ReadTxn, claimed claims, claimedByClient bool, asked map[string]bool, workloads func(func(*workload.Workload) bool), answer *responses) ([]string, error) {
	ts.claims = claims{}
	if ts.wildcard {
		ts.held = nil
	} else {
		ts.held = map[string]uint64{}
	}
	st.local = st.localIn(txn, true)
	found := 0 // claims that name a workload of txn
	for w := range workloads {
		uid := w.UID()
		version, had := claimed.version(uid)
		if had {
			found++
		}
		switch {
		case !ts.interested(uid) || asked[uid]:
			// Not wanted, or answered by name.
		case had && version == w.Version:
			// The client holds this very version (it said so when it
			// reconnected): it is acknowledged, though not sent again.
			if !ts.wildcard {
				ts.held[uid] = version
			}
			if claimedByClient && st.local(w) {
				st.alreadyHeld = append(st.alreadyHeld, sentWorkload{uid: uid, hbone: w.HBONE})
			}
		default:
			st.sending(ts, w)
			if err := answer.add(outgoing{w: w}); err != nil {
				return nil, err
			}
		}
	}
	// Claims that name no workload any more are removed. Usually there
	// are none, and the claims are not looked at again.
	var removed []string
	if found < claimed.count() {
		gone := map[string]bool{}
		for _, name := range claimed.names {
			if st.resolve(txn, name) == nil && !gone[name] {
				gone[name] = true
				removed = append(removed, strings.Clone(name))
			}
		}
	}
	return removed, nil
}

// askedByUID is the set of names subscribed in a request, nil for none.
func askedByUID(added []string) map[string]bool {
	if len(added) == 0 {
		return nil
	}
	asked := make(map[string]bool, len(added))
	for _, name := range added {
		asked[name] = true
	}
	return asked
}

// subscribeClaims subscribes the names an on-demand client's first request
// claims to hold: ztunnel reconnecting names them there only, not again in
// resource_names_subscribe, and wants their changes (istiod, too, keeps
// them watched). The claims live only while the request is handled: the
// names kept are the table's uids or copies.
func (st *stream) subscribeClaims(ts *typeState, txn statedb.ReadTxn) {
	for _, name := range ts.claims.names {
		if _, ok := ts.names[name]; ok {
			continue
		}
		w := st.resolve(txn, name)
		switch {
		case w == nil:
			name = strings.Clone(name)
			ts.names[name] = ""
			ts.await(name) // answered as removed below
		case w.UID() == name:
			ts.resolve(w.UID(), w.UID())
		default:
			ts.resolve(strings.Clone(name), w.UID())
		}
	}
}

// holdsExactly reports whether a wildcard client's first request claims
// exactly the workloads of txn at their versions (a reconnect with nothing
// changed meanwhile), by the digest of both. The client then holds txn's
// view; its claims of this node's workloads are acknowledged.
func (st *stream) holdsExactly(ts *typeState, txn statedb.ReadTxn) bool {
	if !ts.wildcard || ts.claims.digest.Count == 0 {
		return false
	}
	digest, ok := st.srv.Digests.At(txn, st.srv.Workloads)
	if !ok || digest != ts.claims.digest {
		return false
	}
	ts.held, ts.claims = nil, claims{}
	for pod := range st.srv.Pods.List(txn, tables.PodsOfThisNode()) {
		uid := workload.UID(st.srv.WorkloadConfig.ClusterID, pod.Namespace, pod.Name)
		if w, _, found := st.srv.Workloads.Get(txn, workload.ByUID(uid)); found {
			st.alreadyHeld = append(st.alreadyHeld, sentWorkload{uid: w.UID(), hbone: w.HBONE})
		}
	}
	st.srv.Metrics.ReconnectsUnchanged.Inc()
	return true
}

// sending records that w goes to the client.
func (st *stream) sending(ts *typeState, w *workload.Workload) {
	if !ts.wildcard {
		ts.held[w.UID()] = w.Version
	}
	if st.local(w) {
		if st.localHBONE == nil {
			st.localHBONE = map[string]bool{}
		}
		st.localHBONE[w.UID()] = w.HBONE
	}
}

// materializeHeld lists what a wildcard client holds (the view's
// workloads), as it leaves wildcard.
func (st *stream) materializeHeld(ts *typeState) {
	ts.held = map[string]uint64{}
	if st.view == nil {
		return
	}
	for w := range st.srv.Workloads.All(st.view) {
		ts.held[w.UID()] = w.Version
	}
	st.view = nil // not kept alive (a snapshot of every table)
}

// localIn returns a test for this node's workloads in txn. For a whole
// snapshot (many) it reads this node's pods once instead of a pod for every
// workload.
func (st *stream) localIn(txn statedb.ReadTxn, many bool) func(*workload.Workload) bool {
	node := st.srv.Node.NodeName
	if node == "" {
		return func(*workload.Workload) bool { return false }
	}
	if !many {
		return func(w *workload.Workload) bool {
			key, ok := workload.PodOf(w.UID())
			if !ok {
				return false
			}
			pod, _, found := st.srv.Pods.Get(txn, tables.PodByKey(key))
			return found && pod.NodeName == node
		}
	}
	uids := map[string]struct{}{}
	for pod := range st.srv.Pods.List(txn, tables.PodsOfThisNode()) {
		uids[workload.UID(st.srv.WorkloadConfig.ClusterID, pod.Namespace, pod.Name)] = struct{}{}
	}
	return func(w *workload.Workload) bool {
		_, ok := uids[w.UID()]
		return ok
	}
}

// resolve finds the workload an on-demand name means: a uid or "network/ip".
func (st *stream) resolve(txn statedb.ReadTxn, name string) *workload.Workload {
	if w, _, found := st.srv.Workloads.Get(txn, workload.ByUID(name)); found {
		return w
	}
	ip, ok := aliasAddr(name)
	if !ok {
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

// changesSince returns what changed in the workloads table since the
// last push, up to txn: for a wildcard client against its view, for an
// on-demand one against what it holds.
func (st *stream) changesSince(ts *typeState, txn statedb.ReadTxn) ([]outgoing, []string) {
	changes, _ := st.changes.Next(txn)
	st.local = st.localIn(txn, false)
	var out []outgoing
	var removed []string
	for c := range changes {
		w := c.Object
		if c.Deleted {
			// An object deleted and inserted again comes as both: the
			// table as of txn decides.
			uid := w.UID()
			if _, _, back := st.srv.Workloads.Get(txn, workload.ByUID(uid)); back {
				continue
			}
			if st.holdsNow(ts, uid) {
				if !ts.wildcard {
					delete(ts.held, uid)
					out = append(out, st.followAddresses(ts, txn, ts.unresolve(uid))...)
				}
				removed = append(removed, uid)
			}
			continue
		}
		if !ts.interested(w.UID()) {
			if names := st.awaitedBy(ts, txn, w); len(names) > 0 {
				for _, name := range names {
					ts.resolve(name, w.UID())
					out = append(out, outgoing{w: w, alias: name})
				}
				st.sending(ts, w)
			}
			continue
		}
		if st.heldVersion(ts, w) {
			continue
		}
		out = append(out, outgoing{w: w})
		st.sending(ts, w)
	}
	return out, removed
}

// followAddresses resolves names that lost their workload again: to the
// workload that has the address now, or awaited until one takes it.
func (st *stream) followAddresses(ts *typeState, txn statedb.ReadTxn, names []string) []outgoing {
	var out []outgoing
	for _, name := range names {
		w := st.resolve(txn, name)
		if w == nil {
			ts.await(name)
			continue
		}
		ts.resolve(name, w.UID())
		out = append(out, outgoing{w: w, alias: name})
		st.sending(ts, w)
	}
	return out
}

// awaitedBy returns the awaited names of w's addresses.
func (st *stream) awaitedBy(ts *typeState, txn statedb.ReadTxn, w *workload.Workload) []string {
	if len(ts.awaited) == 0 {
		return nil
	}
	key, _ := workload.PodOf(w.UID())
	pod, _, found := st.srv.Pods.Get(txn, tables.PodByKey(key))
	if !found {
		return nil
	}
	var names []string
	for _, ip := range tables.PodAddrs(txn, st.srv.CNIPods, pod) {
		names = append(names, ts.awaited[ip]...)
	}
	return names
}

// holdsNow reports whether the client holds uid.
func (st *stream) holdsNow(ts *typeState, uid string) bool {
	if ts.wildcard {
		if st.view == nil {
			return false
		}
		_, _, found := st.srv.Workloads.Get(st.view, workload.ByUID(uid))
		return found
	}
	_, held := ts.held[uid]
	return held
}

// heldVersion reports whether the client holds w at its version.
func (st *stream) heldVersion(ts *typeState, w *workload.Workload) bool {
	if ts.wildcard {
		if st.view == nil {
			return false
		}
		old, _, found := st.srv.Workloads.Get(st.view, workload.ByUID(w.UID()))
		return found && old.Version == w.Version
	}
	v, held := ts.held[w.UID()]
	return held && v == w.Version
}

// pushChanges sends what changed in the workloads table since the last
// push, and returns the channel that closes on the next change.
func (st *stream) pushChanges() (<-chan struct{}, error) {
	// Regions name the steps of a push in an execution trace
	// (hack/xdstrace breaks the change latency down with them).
	defer trace.StartRegion(st.ctx, "xds push").End()
	ts := st.types[AddressType]
	txn := st.srv.DB.ReadTxn()
	out, removed := st.changesSince(ts, txn)
	if ts.wildcard {
		st.view = txn
	}
	// The iterator is consumed: asking again gives the channel of the
	// next change (or, if one came meanwhile, a closed one), rather than
	// a closed channel that would wake the loop for nothing.
	_, watch := st.changes.Next(txn)
	if len(out) == 0 && len(removed) == 0 {
		return watch, nil
	}
	return watch, st.send(AddressType, out, removed)
}

// send queues responses of at most XDSMaxResourcesPerResponse resources
// (removals go with the last). An empty answer is still one response.
func (st *stream) send(typeURL string, out []outgoing, removed []string) error {
	r := st.respond(typeURL)
	for _, o := range out {
		if err := r.add(o); err != nil {
			return err
		}
	}
	return r.finish(removed)
}

// responses is one answer being sent: resources are added one by one and
// each full response is queued to the sender at once, so that the start
// of a large answer (a snapshot) is on the wire while the rest is still
// being read from the table.
type responses struct {
	st      *stream
	typeURL string
	out     []outgoing
	// queued counts the responses queued, sent the resources they carried.
	queued, sent int
	timeout      *time.Timer
}

func (st *stream) respond(typeURL string) *responses {
	return &responses{st: st, typeURL: typeURL}
}

// add adds o to the answer, queueing a response when it is full.
func (r *responses) add(o outgoing) error {
	r.out = append(r.out, o)
	if len(r.out) < r.st.srv.Config.XDSMaxResourcesPerResponse {
		return nil
	}
	return r.queue(nil)
}

// finish queues the last response, with the removals.
func (r *responses) finish(removed []string) error {
	if len(r.out) > 0 || len(removed) > 0 || r.queued == 0 {
		if err := r.queue(removed); err != nil {
			return err
		}
	}
	r.done()
	return nil
}

// done records what the answer sent (in the metrics and the client's
// row, once per answer rather than per response).
func (r *responses) done() {
	if r.timeout != nil {
		r.timeout.Stop()
	}
	if r.sent > 0 {
		sent := r.sent
		r.st.srv.Metrics.ResourcesSent.WithLabelValues(shortType(r.typeURL)).Add(float64(sent))
		r.st.record(func(c *Client) { c.ResourcesSent += sent })
		r.sent = 0
	}
}

// queue encodes the resources added since the last response, with
// removed, and hands the response to the sender: at once if it is free,
// else waiting up to XDSSendTimeout. When it cannot, what was sent so far
// is recorded: the stream ends with the error.
func (r *responses) queue(removed []string) (err error) {
	defer func() {
		if err != nil {
			r.done()
		}
	}()
	st := r.st
	st.nonce++
	resp := newResponse(st.srv.buffers, r.typeURL, strconv.FormatUint(st.nonce, 10), r.out, removed)
	st.track(st.nonce, r.typeURL, r.out, removed)
	n := len(r.out) + len(removed)
	r.out = r.out[:0] // encoded: the slice is free again
	select {
	case st.sendq <- resp:
	default:
		// The sender is busy: wait, but not forever.
		if r.timeout == nil {
			r.timeout = time.NewTimer(st.srv.Config.XDSSendTimeout)
		} else {
			r.timeout.Reset(st.srv.Config.XDSSendTimeout)
		}
		select {
		case st.sendq <- resp:
		case err := <-st.sendErr:
			return err
		case <-st.ctx.Done():
			return st.ctx.Err()
		case <-r.timeout.C:
			return fmt.Errorf("client took no response for %s: closing the stream", st.srv.Config.XDSSendTimeout)
		}
	}
	r.queued++
	r.sent += n
	return nil
}

// acknowledged settles the Address responses up to nonce: the client
// answers a type's responses in order, so older ones still pending were
// answered already or never will be. An ACK records this node's workloads
// the response carried. After a NACK the client's copy of them is unknown
// (ztunnel applies the resources it does not reject): their rows go, and
// the bypass check reports them until they are acknowledged again.
func (st *stream) acknowledged(nonce string, ack bool) {
	n, err := strconv.ParseUint(nonce, 10, 64)
	if err != nil {
		return
	}
	if sent, ok := st.pending[n]; ok {
		if !ack {
			unknown := make([]sentWorkload, len(sent))
			for i, w := range sent {
				unknown[i] = sentWorkload{uid: w.uid, removed: true}
			}
			sent = unknown
		}
		st.holds(sent)
	}
	for k, sent := range st.pending {
		if k <= n {
			st.settle(k, sent)
		}
	}
}

// settle forgets a pending response.
func (st *stream) settle(nonce uint64, sent []sentWorkload) {
	delete(st.pending, nonce)
	st.pendingWorkloads -= len(sent)
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

// track remembers what response nonce carries of this node's workloads.
func (st *stream) track(nonce uint64, typeURL string, out []outgoing, removed []string) {
	if typeURL != AddressType {
		return
	}
	var sent []sentWorkload
	for _, o := range out {
		uid := o.w.UID()
		if hbone, ok := st.localHBONE[uid]; ok {
			sent = append(sent, sentWorkload{uid: uid, hbone: hbone})
			delete(st.localHBONE, uid)
		}
	}
	for _, uid := range removed {
		sent = append(sent, sentWorkload{uid: uid, removed: true})
	}
	if len(sent) == 0 {
		return
	}
	if st.pending == nil {
		st.pending = map[uint64][]sentWorkload{}
	}
	st.pending[nonce] = sent
	st.pendingWorkloads += len(sent)
	// A client that never acknowledges must not grow this without end.
	for st.pendingWorkloads > maxPendingWorkloads && len(st.pending) > 1 {
		oldest := slices.Min(slices.Collect(maps.Keys(st.pending)))
		st.settle(oldest, st.pending[oldest])
	}
}

// maxPendingWorkloads bounds the workloads a stream tracks in responses not
// yet acknowledged. Counted in workloads, not responses: a snapshot split
// into a hundred responses carries each of this node's workloads once,
// and its acknowledgements are read only once it is all queued.
const maxPendingWorkloads = 1 << 14

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n] + "..."
	}
	return s
}

// record updates the stream's xds-clients row; flush writes it. A
// request's changes are written when it is handled, before its answer
// leaves (what that answer sent follows with the next write), and a push's
// count rides along with the next write: a push hands its response to the
// sender without a table write in between, which on a busy node would
// hold the sender back.
func (st *stream) record(update func(*Client)) {
	update(st.client)
	st.dirty = true
}

func (st *stream) flush() {
	if !st.dirty {
		return
	}
	st.dirty = false
	row := *st.client
	row.Subscriptions = maps.Clone(st.client.Subscriptions)
	txn := st.srv.DB.WriteTxn(st.srv.Clients)
	st.srv.Clients.Insert(txn, &row)
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
