// SPDX-License-Identifier: Apache-2.0

package cni

import (
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/cilium/statedb"

	"github.com/mtlsbridge/mtlsbridge/cni/plugin"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/enrollment"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// A pod enrolled by its namespace's label, asked about before the agent
// has listed namespaces (it just started), or before its namespace is
// known: no answer the plugin takes as final, until the view is whole.
func TestDecisionWaitsForTheWholeView(t *testing.T) {
	db := statedb.New()
	pods, err := tables.NewPodsTable(db, tables.LocalNode{NodeName: "node-a"})
	must(t, err)
	namespaces, err := tables.NewNamespacesTable(db)
	must(t, err)
	policies, err := tables.NewPoliciesTable(db)
	must(t, err)
	wtxn := db.WriteTxn(pods, namespaces, policies)
	pods.Insert(wtxn, &tables.Pod{Namespace: "mesh", Name: "api", NodeName: "node-a", IPs: []netip.Addr{netip.MustParseAddr("10.0.1.10")}})
	listed := namespaces.RegisterInitializer(wtxn, "listing")
	wtxn.Commit()
	h := &handler{handlerParams: handlerParams{
		Log: slog.New(slog.DiscardHandler), DB: db, Enrollment: enrollment.Config{TrustDomain: "cluster.local"},
		Pods: pods, Namespaces: namespaces, Policies: policies,
	}, mode: settlingMode{}}

	ans, watches := h.decide("mesh/api", plugin.Request{})
	if ans.Final() || ans.Detail != ErrViewIncomplete.Error() {
		t.Fatalf("answer before namespaces are listed: %+v, want not known, %q", ans, ErrViewIncomplete)
	}
	// Listed, but without the pod's namespace (its informer lags behind
	// the pods'): still no final answer.
	wtxn = db.WriteTxn(namespaces)
	listed(wtxn)
	wtxn.Commit()
	if _, err := watches.Wait(t.Context(), 0); err != nil {
		t.Fatal("the long poll is not woken once the namespaces are listed")
	}
	ans, watches = h.decide("mesh/api", plugin.Request{})
	if ans.Final() || ans.Detail != `namespace "mesh" not known yet` {
		t.Fatalf("answer before the pod's namespace is known: %+v, want not known", ans)
	}
	wtxn = db.WriteTxn(namespaces)
	namespaces.Insert(wtxn, &tables.Namespace{Name: "mesh", Labels: tables.NewLabels(map[string]string{tables.NamespaceEnabledLabel: "true"})})
	wtxn.Commit()
	if _, err := watches.Wait(t.Context(), 0); err != nil {
		t.Fatal("the long poll is not woken once the namespace is known")
	}
	if ans, _ := h.decide("mesh/api", plugin.Request{}); !ans.Known || !ans.Enrolled || ans.Reason != enrollment.ReasonNamespaceLabel {
		t.Errorf("answer once listed: %+v, want enrolled by the namespace label", ans)
	}
}

// A DEL that comes while an ADD of the same container is still being
// answered (the runtime gave up on the ADD) removes the container's report
// for good: the ADD's answer, given after, does not record it again, or
// a dead sandbox's report would be its pod's newest. A later ADD of that
// container is recorded.
func TestDeletedWhileAnswered(t *testing.T) {
	mux, h := fuzzHandler(t)
	serve := func(method, target, body string) *httptest.ResponseRecorder {
		req := httptest.NewRequest(method, "http://agent"+target, strings.NewReader(body))
		rec := httptest.NewRecorder()
		mux.ServeHTTP(rec, req)
		return rec
	}
	report := func() (*tables.CNIPod, bool) {
		row, _, ok := h.CNIPods.Get(h.DB.ReadTxn(), tables.CNIPodByContainer("c1"))
		return row, ok
	}
	const add = `{"containerID": "c1", "podUID": "u-web", "ips": ["10.0.1.10"], "netns": "/run/netns/web"}`
	answered := make(chan *httptest.ResponseRecorder)
	go func() { answered <- serve("POST", plugin.PodPathPrefix+"app/web?wait=500ms", add) }()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		if _, ok := report(); ok {
			break // web is enrolled, never steered here: the ADD waits
		} else if time.Now().After(deadline) {
			t.Fatal("no report while the ADD waits")
		}
	}
	if rec := serve("DELETE", plugin.ContainerPathPrefix+"c1", ""); rec.Code != http.StatusNoContent {
		t.Fatalf("DEL: %d %s", rec.Code, rec.Body)
	}
	if rec := <-answered; rec.Code != http.StatusOK {
		t.Fatalf("ADD: %d %s", rec.Code, rec.Body)
	}
	if row, ok := report(); ok {
		t.Fatalf("the ADD's answer recorded the deleted container again: %+v", row)
	}
	if rows, _ := h.Store.load(); len(rows) > 0 {
		t.Fatalf("the deleted container is back in the state folder: %+v", rows[0])
	}

	if rec := serve("POST", plugin.PodPathPrefix+"app/web?wait=1ms", add); rec.Code != http.StatusOK {
		t.Fatalf("ADD again: %d %s", rec.Code, rec.Body)
	}
	if _, ok := report(); !ok {
		t.Fatal("an ADD after the DEL is not recorded")
	}
}
