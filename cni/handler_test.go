// SPDX-License-Identifier: Apache-2.0

package cni

import (
	"log/slog"
	"net/netip"
	"testing"

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
	h := &handler{handlerParams{
		Log: slog.New(slog.DiscardHandler), DB: db, Enrollment: enrollment.Config{TrustDomain: "cluster.local"},
		Pods: pods, Namespaces: namespaces, Policies: policies,
	}, settlingMode{}}

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
