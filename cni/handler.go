// SPDX-License-Identifier: Apache-2.0

package cni

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/netip"
	"reflect"
	"slices"
	"sync"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"

	"github.com/mtlsbridge/mtlsbridge/api"
	"github.com/mtlsbridge/mtlsbridge/cni/plugin"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/enrollment"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/steering"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

type handlerParams struct {
	cell.In

	Log        *slog.Logger
	DB         *statedb.DB
	Enrollment enrollment.Config
	Pods       statedb.Table[*tables.Pod]
	Namespaces statedb.Table[*tables.Namespace]
	Policies   statedb.Table[*tables.Policy]
	CNIPods    statedb.RWTable[*tables.CNIPod]
	Reports    tables.CNIReports
	Store      *store
	Metrics    *metrics
	// Modes: the active one says whether an enrolled pod is steered.
	Modes steering.Modes
}

type handlersOut struct {
	cell.Out

	Ask    api.Handler `group:"api-handlers"`
	Forget api.Handler `group:"api-handlers"`
}

func newHandlers(p handlerParams) (handlersOut, error) {
	mode, err := p.Modes.Active()
	if err != nil {
		return handlersOut{}, fmt.Errorf("cni: %w", err)
	}
	return (&handler{handlerParams: p, mode: mode}).routes(), nil
}

// routes are the plugin's routes on api.sock.
func (h *handler) routes() handlersOut {
	return handlersOut{
		Ask:    api.Handler{Pattern: "POST " + plugin.PodPathPrefix + "{namespace}/{name}", Handler: http.HandlerFunc(h.ask)},
		Forget: api.Handler{Pattern: "DELETE " + plugin.ContainerPathPrefix + "{id}", Handler: http.HandlerFunc(h.forget)},
	}
}

type handler struct {
	handlerParams
	mode steering.Mode

	// mu orders reports and deletions of containers.
	mu sync.Mutex
	// deleted holds when a DEL came for a container, for a while: the
	// answer to an ADD asked before it (the runtime gave up on the ADD,
	// then deleted the sandbox) must not record the container again. A
	// dead sandbox's report would then be its pod's newest, and the
	// in-pod mode would ask for the redirection there rather than in the
	// live sandbox.
	deleted map[string]time.Time
	// swept is when deleted last lost what it no longer needs.
	swept time.Time
}

// deletedMemory is how long a deletion is remembered: longer than any
// answer is held (plugin.MaxWait).
const deletedMemory = time.Minute

// ask answers the plugin's question for one container of a pod, holding
// the answer (up to ?wait=) until it is final. The row of the container in
// cni-pods records the last answer.
func (h *handler) ask(w http.ResponseWriter, r *http.Request) {
	key := r.PathValue("namespace") + "/" + r.PathValue("name")
	var req plugin.Request
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<16)).Decode(&req); err != nil {
		http.Error(w, "bad request body: "+err.Error(), http.StatusBadRequest)
		return
	}
	if err := validContainerID(req.ContainerID); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	ips, err := podAddrs(req.IPs)
	if err != nil {
		h.Log.Warn("CNI report refused", "pod", key, "container", req.ContainerID, "error", err)
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	req.IPs = ips
	var wait time.Duration
	if s := r.URL.Query().Get("wait"); s != "" {
		d, err := time.ParseDuration(s)
		if err != nil || d < 0 {
			http.Error(w, "bad wait: "+s, http.StatusBadRequest)
			return
		}
		wait = min(d, plugin.MaxWait)
	}
	start := time.Now()
	ctx, cancel := context.WithTimeout(r.Context(), wait)
	defer cancel()

	var ans plugin.Answer
	first := true
	for {
		var watches *statedb.WatchSet
		ans, watches = h.decide(key, req)
		if first && !ans.Final() {
			h.record(key, req, ans, start) // operators see who is waiting
		}
		first = false
		if ans.Final() {
			break
		}
		if _, err := watches.Wait(ctx, 0); err != nil {
			if r.Context().Err() != nil {
				return // the plugin went away
			}
			break // waited long enough: the answer is the last one
		}
	}
	h.record(key, req, ans, start)
	h.Metrics.answers.WithLabelValues(answerLabel(ans)).Observe(time.Since(start).Seconds())
	h.Log.Info("CNI pod start", "pod", key, "container", req.ContainerID, "ips", req.IPs,
		"enrolled", ans.Enrolled, "reason", ans.Reason, "redirect", ans.Redirect, "known", ans.Known,
		"waited", time.Since(start))
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(ans)
}

// ErrViewIncomplete: the agent has not listed pods, namespaces and
// policies yet, so it cannot decide on a pod.
var ErrViewIncomplete = errors.New("the agent has not listed pods, namespaces and policies yet")

// decide computes the answer in one snapshot and returns what to watch for
// a change of it.
func (h *handler) decide(key string, req plugin.Request) (plugin.Answer, *statedb.WatchSet) {
	txn := h.DB.ReadTxn()
	w := statedb.NewWatchSet()
	// Decided on a partial view (the agent just started, its first
	// listings not all in), a pod enrolled by its namespace or a policy
	// would be "not selected": a final answer, and it starts unprotected.
	for _, t := range []interface {
		Initialized(statedb.ReadTxn) (bool, <-chan struct{})
	}{h.Pods, h.Namespaces, h.Policies} {
		if ok, listed := t.Initialized(txn); !ok {
			w.Add(listed)
			return plugin.Answer{Detail: ErrViewIncomplete.Error()}, w
		}
	}
	pod, _, podWatch, found := h.Pods.GetWatch(txn, tables.PodByKey(key))
	w.Add(podWatch)
	if !found || !pod.MatchesUID(req.PodUID) {
		return plugin.Answer{}, w // not in the API yet, or only its namesake
	}
	_, namespaces := h.Namespaces.AllWatch(txn)
	_, policies := h.Policies.AllWatch(txn)
	w.Add(namespaces, policies)
	w.Add(h.mode.Watch(txn)...)

	// Decide on the sandbox being added: its addresses are not in the API
	// yet, or belong to the sandbox it replaces.
	asReported := *pod
	if len(req.IPs) > 0 {
		asReported.IPs = req.IPs
	}
	e := enrollment.Decide(h.Enrollment, txn, h.Namespaces, h.Policies, &asReported)
	if !e.Enrolled && !e.Excluded() {
		// Not selected might be by a namespace the agent has not seen
		// yet (its informer behind the pods'): no final answer on that.
		// The namespaces' watch, added above, wakes the long poll.
		if _, _, found := h.Namespaces.Get(txn, tables.NamespaceByName(pod.Namespace)); !found {
			return plugin.Answer{Detail: fmt.Sprintf("namespace %q not known yet", pod.Namespace)}, w
		}
	}
	ans := plugin.Answer{Known: true, Enrolled: e.Enrolled, Reason: e.Reason}
	if !e.Enrolled {
		ans.Redirect = plugin.RedirectNotNeeded
		return ans, w
	}
	// The active mode's own words: in l2 mode the datapath's rows, in
	// in-pod mode the rules in the pod and ztunnel's acknowledgement.
	if state, detail := h.mode.Steering(txn, key, steering.Sandbox{IPs: asReported.IPs, Netns: req.Netns}); state != steering.Steered {
		ans.Redirect, ans.Detail = plugin.RedirectPending, detail
	} else {
		ans.Redirect = plugin.RedirectReady
	}
	return ans, w
}

// record keeps the answer to a question asked at asked, unless the
// container was deleted since.
func (h *handler) record(key string, req plugin.Request, ans plugin.Answer, asked time.Time) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if at, ok := h.deleted[req.ContainerID]; ok && !at.Before(asked) {
		return
	}
	state := tables.CNIStateWaiting
	if ans.Final() {
		state = tables.CNIStateAllowed
	}
	row := &tables.CNIPod{
		ContainerID: req.ContainerID, Pod: key, UID: req.PodUID, IPs: req.IPs, Netns: req.Netns, IfName: req.IfName,
		Enrolled: ans.Enrolled, Reason: ans.Reason, Redirect: ans.Redirect, State: state,
	}
	// A plugin that asks again (an unknown pod, a pending redirect) with
	// the same answer changes nothing: no write, on disk or in the table.
	if old, _, ok := h.CNIPods.Get(h.DB.ReadTxn(), tables.CNIPodByContainer(req.ContainerID)); ok && sameReport(old, row) {
		return
	}
	row.Updated = time.Now()
	h.Reports.Keep(row, nil)
}

// podAddrs checks the addresses of a report and puts them in canonical
// form, without duplicates.
func podAddrs(in []netip.Addr) ([]netip.Addr, error) {
	out := make([]netip.Addr, 0, len(in))
	for _, a := range in {
		a, err := tables.PodAddr(a)
		if err != nil {
			return nil, fmt.Errorf("ips: %s: %w", a, err)
		}
		if !slices.Contains(out, a) {
			out = append(out, a)
		}
	}
	return out, nil
}

// sameReport compares two rows but for the time of the report.
func sameReport(a, b *tables.CNIPod) bool {
	x, y := *a, *b
	x.Updated, y.Updated = time.Time{}, time.Time{}
	return reflect.DeepEqual(x, y)
}

// forget removes a container's row (CNI DEL).
func (h *handler) forget(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	if validContainerID(id) != nil {
		w.WriteHeader(http.StatusNoContent) // never stored
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	now := time.Now()
	if h.deleted == nil {
		h.deleted = map[string]time.Time{}
	}
	if now.Sub(h.swept) > deletedMemory {
		for other, at := range h.deleted {
			if now.Sub(at) > deletedMemory {
				delete(h.deleted, other)
			}
		}
		h.swept = now
	}
	h.deleted[id] = now
	wtxn := h.DB.WriteTxn(h.CNIPods)
	if old, _, ok := h.CNIPods.Get(wtxn, tables.CNIPodByContainer(id)); ok {
		h.CNIPods.Delete(wtxn, old)
		h.Log.Info("CNI container deleted", "pod", old.Pod, "container", id)
	}
	wtxn.Commit()
	if err := h.Store.remove(id); err != nil {
		h.Log.Warn("Cannot remove a CNI report from the state folder", "container", id, "error", err)
	}
	w.WriteHeader(http.StatusNoContent)
}
