// SPDX-License-Identifier: Apache-2.0

package workload

import (
	"encoding/json"
	"net/netip"
	"strings"
	"testing"

	"istio.io/istio/pkg/workloadapi"

	"github.com/mtlsbridge/mtlsbridge/tables"
)

// The Workload built for a pod carries what ztunnel needs, under Istio's
// names and label precedence, and its version follows its content.
func TestNew(t *testing.T) {
	pod := &tables.Pod{
		Namespace: "shop", Name: "web-7d9f8b6c5-x2x4z", NodeName: "node-a",
		Labels: tables.NewLabels(map[string]string{"pod-template-hash": "7d9f8b6c5", "app": "web", "app.kubernetes.io/name": "storefront", "version": "v2"}),
		IPs:    []netip.Addr{netip.MustParseAddr("10.0.1.5"), netip.MustParseAddr("fd00::5")},
	}
	w, err := New("cluster-1", "example.org", pod, true)
	if err != nil {
		t.Fatal(err)
	}
	got := w.Decode()
	want := &workloadapi.Workload{
		Uid: "cluster-1//Pod/shop/web-7d9f8b6c5-x2x4z", Name: "web-7d9f8b6c5-x2x4z", Namespace: "shop",
		Node: "node-a", TrustDomain: "example.org", ClusterId: "cluster-1", // service account: the default, left out
		WorkloadType: workloadapi.WorkloadType_POD, WorkloadName: "web", CanonicalName: "storefront",
		CanonicalRevision: "v2", TunnelProtocol: workloadapi.TunnelProtocol_HBONE,
		Addresses: [][]byte{netip.MustParseAddr("10.0.1.5").AsSlice(), netip.MustParseAddr("fd00::5").AsSlice()},
	}
	if got.String() != want.String() {
		t.Errorf("Workload\n got %v\nwant %v", got, want)
	}
	if w.UID() != want.Uid || !w.HBONE {
		t.Errorf("row %+v", w)
	}

	// Defaults are left out, as agents read an empty trust domain as
	// cluster.local, cluster id as Kubernetes, service account as default;
	// any other value is sent.
	defaults := mustNew(t, "Kubernetes", "cluster.local", pod, true).Decode()
	if defaults.GetTrustDomain() != "" || defaults.GetClusterId() != "" || defaults.GetServiceAccount() != "" {
		t.Errorf("defaults sent: trust domain %q, cluster id %q, service account %q", defaults.GetTrustDomain(), defaults.GetClusterId(), defaults.GetServiceAccount())
	}
	withSA := *pod
	withSA.ServiceAccount = "storefront"
	if sa := mustNew(t, "Kubernetes", "cluster.local", &withSA, true).Decode().GetServiceAccount(); sa != "storefront" {
		t.Errorf("service account %q sent, want storefront", sa)
	}

	// A row locates its uid in 16 bits: a uid longer is refused, not cut.
	if _, err := New(strings.Repeat("c", 1<<16), "example.org", pod, true); err == nil {
		t.Error("a uid of 64 KiB encoded")
	}

	same, _ := New("cluster-1", "example.org", pod, true)
	notReady, _ := New("cluster-1", "example.org", pod, false)
	if same.Version != w.Version || notReady.Version == w.Version {
		t.Errorf("versions %x %x %x: want equal content, equal version; HBONE off, another", w.Version, same.Version, notReady.Version)
	}
	if notReady.Decode().GetTunnelProtocol() != workloadapi.TunnelProtocol_NONE {
		t.Error("a pod not redirected is told HBONE")
	}

	var shown struct {
		Version  string
		Workload map[string]any
	}
	b, err := json.Marshal(w)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &shown); err != nil {
		t.Fatal(err)
	}
	if shown.Version != w.VersionString() || shown.Workload["workloadName"] != "web" {
		t.Errorf("JSON %s", b)
	}
	if addrs, _ := shown.Workload["addresses"].([]any); len(addrs) != 2 || addrs[0] != "10.0.1.5" || addrs[1] != "fd00::5" {
		t.Errorf("JSON addresses %v, want IPs", shown.Workload["addresses"])
	}
}

func mustNew(t *testing.T, clusterID, trustDomain string, pod *tables.Pod, hbone bool) *Workload {
	t.Helper()
	w, err := New(clusterID, trustDomain, pod, hbone)
	if err != nil {
		t.Fatal(err)
	}
	return w
}
