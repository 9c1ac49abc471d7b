// SPDX-License-Identifier: Apache-2.0

package ingest

import (
	"encoding/json"
	"runtime"
	"testing"
	"unique"
	"unsafe"

	corev1 "k8s.io/api/core/v1"

	"github.com/mtlsbridge/mtlsbridge/tables"
)

// TestPodsShareTheirCommonStrings: two replicas decoded one by one (each
// with copies of its own, as client-go decodes them) share, once
// converted, the text of their namespace, node, service account, phase
// and labels; each keeps its own name.
func TestPodsShareTheirCommonStrings(t *testing.T) {
	replica := func(name string) *corev1.Pod {
		return decodePod(t, `{"metadata": {"namespace": "team-1", "name": "`+name+`", "labels": {"app": "web", "pod-template-hash": "7d9f8b6c5"}},
			"spec": {"nodeName": "ip-10-0-1-23.ec2.internal", "serviceAccountName": "web"}, "status": {"phase": "Running"}}`)
	}
	// Held, so that a garbage collection in between cannot make the
	// runtime forget the shared copy (interning keeps no handle).
	held := []unique.Handle[string]{unique.Make("team-1"), unique.Make("ip-10-0-1-23.ec2.internal"), unique.Make("web"), unique.Make("Running"),
		unique.Make("app\x00web\x00pod-template-hash\x007d9f8b6c5")}
	apiA, apiB := replica("web-7d9f8b6c5-aaaaa"), replica("web-7d9f8b6c5-bbbbb")
	a, b := convertPod(t, apiA), convertPod(t, apiB)
	expectSharedText(t, a, b, "namespace", "node", "service account", "phase", "labels")
	if sameText(apiA.Namespace, apiB.Namespace) {
		t.Fatal("the decoder shared the namespace itself: the test shows nothing")
	}
	if !sameText(a.Name, apiA.Name) {
		t.Error("the name was copied: each pod has its own, nothing to share")
	}
	runtime.KeepAlive(held)
}

// expectSharedText checks that a and b hold one copy of each field's text
// (labels: the value of "app", a slice of the labels' text as Lookup
// returns it).
func expectSharedText(t *testing.T, a, b *tables.Pod, fields ...string) {
	t.Helper()
	text := map[string]func(*tables.Pod) string{
		"namespace":       func(p *tables.Pod) string { return p.Namespace },
		"node":            func(p *tables.Pod) string { return p.NodeName },
		"service account": func(p *tables.Pod) string { return p.ServiceAccount },
		"phase":           func(p *tables.Pod) string { return p.Phase },
		"labels":          func(p *tables.Pod) string { v, _ := p.Labels.Lookup("app"); return v },
	}
	for _, field := range fields {
		if x, y := text[field](a), text[field](b); !sameText(x, y) {
			t.Errorf("%s: %q and %q are separate copies, want one shared", field, x, y)
		}
	}
}

// TestUpdatesKeepSharedText: a pod updated after a garbage collection (when
// interning has forgotten the copy its replicas share) keeps sharing it:
// its row takes the text of its previous row where it did not change.
func TestUpdatesKeepSharedText(t *testing.T) {
	replica := func(name, phase string) *tables.Pod {
		return convertPod(t, decodePod(t, `{"metadata": {"namespace": "team-keep", "name": "`+name+`", "labels": {"app": "keep"}},
			"spec": {"nodeName": "node-keep", "serviceAccountName": "keep"}, "status": {"phase": "`+phase+`"}}`))
	}
	previous := replica("keep-b", "Pending")
	// A collection sweeps the interned copies no handle refers to: the
	// runtime forgets them, and the update's conversion makes new ones.
	runtime.GC()
	merge := podSink(nil, newIdentities(nil)).opts.Merge
	updated := merge(previous, true, replica("keep-b", "Running"))
	// The previous row's text is the one its replicas share.
	expectSharedText(t, previous, updated, "namespace", "node", "service account", "labels")
	if updated.Phase != "Running" {
		t.Errorf("phase %q after the update, want Running", updated.Phase)
	}
}

// decodePod decodes a pod as client-go does: with strings of its own.
func decodePod(t *testing.T, wire string) *corev1.Pod {
	var pod corev1.Pod
	if err := json.Unmarshal([]byte(wire), &pod); err != nil {
		t.Fatal(err)
	}
	return &pod
}

func convertPod(t *testing.T, pod *corev1.Pod) *tables.Pod {
	row, err := podFromK8s(pod)
	if err != nil {
		t.Fatal(err)
	}
	return row
}

// sameText says whether x and y are one copy of the same text.
func sameText(x, y string) bool { return x == y && unsafe.StringData(x) == unsafe.StringData(y) }
