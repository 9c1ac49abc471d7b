// SPDX-License-Identifier: Apache-2.0

package cni

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"testing"
	"time"

	"github.com/cilium/statedb"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/mtlsbridge/mtlsbridge/api"
	"github.com/mtlsbridge/mtlsbridge/cni/plugin"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/enrollment"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/steering"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// FuzzAPIRequests sends arbitrary requests to the CNI plugin's routes on
// api.sock: any method and path, pod names, wait parameter and body
// (whoever can reach the socket controls them; the plugin relays a
// runtime's container ids and addresses). The handler must never panic,
// must refuse what it cannot use with a 4xx and a message, and what it
// answers must be an Answer whose cni-pods row holds only checked
// addresses. Seeds: testdata/fuzz/FuzzAPIRequests and below. Long runs:
// make fuzz.
func FuzzAPIRequests(f *testing.F) {
	body := func(r plugin.Request) string {
		b, _ := json.Marshal(r)
		return string(b)
	}
	f.Add("POST", "app", "web", "1ms", body(plugin.Request{ContainerID: "abc123", PodUID: "u-web", IPs: []netip.Addr{netip.MustParseAddr("10.0.1.10")}}))
	f.Add("POST", "app", "plain", "", body(plugin.Request{ContainerID: "def456", IPs: []netip.Addr{netip.MustParseAddr("fd00::2"), netip.MustParseAddr("::ffff:10.0.1.11")}}))
	f.Add("POST", "app", "ghost", "10s", `{"containerID": "x", "ips": ["0.0.0.0", "::"]}`)
	f.Add("POST", "app", "web", "-1s", `{"containerID": "../../etc", "ips": "nope"}`)
	f.Add("DELETE", "", "", "", "abc123")
	f.Add("DELETE", "", "", "", "../..")
	f.Add("GET", "kube-system", "x", "bogus", `{}`)

	mux, h := fuzzHandler(f)
	f.Fuzz(func(t *testing.T, method, namespace, name, wait, reqBody string) {
		var target string
		if method == "DELETE" {
			target = plugin.ContainerPathPrefix + url.PathEscape(reqBody)
		} else {
			target = plugin.PodPathPrefix + url.PathEscape(namespace) + "/" + url.PathEscape(name) + "?wait=" + url.QueryEscape(wait)
		}
		req, err := http.NewRequest(method, "http://agent"+target, bytes.NewReader([]byte(reqBody)))
		if err != nil {
			return // not a request a client could send
		}
		// A pending pod waits at most this long, not up to the wait asked.
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
		defer cancel()
		rec := httptest.NewRecorder()
		mux.ServeHTTP(rec, req.WithContext(ctx))
		switch {
		case rec.Body.Len() == 0 && ctx.Err() != nil:
			// Still waiting when the client went: nothing answered.
		case rec.Code == http.StatusOK:
			var ans plugin.Answer
			if err := json.Unmarshal(rec.Body.Bytes(), &ans); err != nil {
				t.Fatalf("200 with a body that is not an Answer: %q", rec.Body.String())
			}
		case rec.Code == http.StatusNoContent, rec.Code == http.StatusMethodNotAllowed, rec.Code == http.StatusNotFound,
			rec.Code >= 300 && rec.Code < 400: // the mux cleaning a path
		case rec.Code >= 400 && rec.Code < 500:
			if len(bytes.TrimSpace(rec.Body.Bytes())) == 0 {
				t.Fatalf("%d without a message", rec.Code)
			}
		default:
			t.Fatalf("status %d: %s", rec.Code, rec.Body.String())
		}
		for row := range h.CNIPods.All(h.DB.ReadTxn()) {
			if validContainerID(row.ContainerID) != nil {
				t.Fatalf("row of container id %q", row.ContainerID)
			}
			for _, ip := range row.IPs {
				if _, err := tables.PodAddr(ip); err != nil || ip != ip.Unmap() {
					t.Fatalf("row with address %v", ip)
				}
			}
		}
	})
}

// fuzzHandler serves the CNI routes from tables with two pods, one
// enrolled by its label (its redirect never done) and one not.
func fuzzHandler(f testing.TB) (*http.ServeMux, *handler) {
	db := statedb.New()
	must := func(err error) {
		if err != nil {
			f.Fatal(err)
		}
	}
	pods, err := tables.NewPodsTable(db, tables.LocalNode{NodeName: "node-a"})
	must(err)
	namespaces, err := tables.NewNamespacesTable(db)
	must(err)
	policies, err := tables.NewPoliciesTable(db)
	must(err)
	cniPods, err := tables.NewCNIPodsTable(db)
	must(err)
	wtxn := db.WriteTxn(pods, namespaces)
	namespaces.Insert(wtxn, &tables.Namespace{Name: "app"})
	pods.Insert(wtxn, &tables.Pod{Namespace: "app", Name: "web", UID: "u-web", NodeName: "node-a",
		Labels: tables.NewLabels(map[string]string{"cilium.io/redir-type": "workload"}), IPs: []netip.Addr{netip.MustParseAddr("10.0.1.10")}})
	pods.Insert(wtxn, &tables.Pod{Namespace: "app", Name: "plain", NodeName: "node-a", IPs: []netip.Addr{netip.MustParseAddr("10.0.1.11")}})
	wtxn.Commit()

	store := newStore(f.TempDir())
	h := &handler{handlerParams: handlerParams{
		Log: slog.New(slog.DiscardHandler), DB: db,
		Enrollment: enrollment.Config{TrustDomain: "cluster.local", ExcludedNamespaces: []string{"kube-system"}},
		Pods:       pods, Namespaces: namespaces, Policies: policies, CNIPods: cniPods,
		Store: store, Reports: reports{log: slog.New(slog.DiscardHandler), db: db, cniPods: cniPods, store: store},
		Metrics: newMetrics(prometheus.NewRegistry()),
	}, mode: settlingMode{}}
	mux := http.NewServeMux()
	routes := h.routes()
	for _, route := range []api.Handler{routes.Ask, routes.Forget} {
		mux.Handle(route.Pattern, route.Handler)
	}
	return mux, h
}

// settlingMode is a steering mode whose redirections are never done.
type settlingMode struct{}

func (settlingMode) Name() string { return "settling" }
func (settlingMode) Steering(statedb.ReadTxn, string, steering.Sandbox) (steering.Steering, string) {
	return steering.Settling, "never done"
}
func (settlingMode) Watch(statedb.ReadTxn) []<-chan struct{} { return nil }
func (settlingMode) Tables() []statedb.TableMeta             { return nil }
