// SPDX-License-Identifier: Apache-2.0

package bypass

import (
	"context"
	"errors"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
)

func TestParseTaint(t *testing.T) {
	for in, want := range map[string]string{
		"mtlsbridge.io/agent-not-ready:NoSchedule":     "mtlsbridge.io/agent-not-ready NoSchedule",
		"mtlsbridge.io/agent-not-ready=true:NoExecute": "mtlsbridge.io/agent-not-ready NoExecute",
		"mtlsbridge.io/agent-not-ready":                "error",
		"mtlsbridge.io/agent-not-ready:NoSuchEffect":   "error",
		":NoSchedule": "error",
	} {
		k, e, err := parseTaint(in)
		got := k + " " + string(e)
		if err != nil {
			got = "error"
		}
		if got != want {
			t.Errorf("parseTaint(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestRemoveTaint(t *testing.T) {
	const key = "mtlsbridge.io/agent-not-ready"
	other := corev1.Taint{Key: "other", Effect: corev1.TaintEffectNoSchedule}
	kube := fake.NewClientset(&corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: "node-a"},
		Spec: corev1.NodeSpec{Taints: []corev1.Taint{
			{Key: key, Effect: corev1.TaintEffectNoSchedule}, other,
			{Key: key, Effect: corev1.TaintEffectNoExecute}, // another effect: kept
		}},
	})
	ctx := context.Background()
	removed, err := removeTaint(ctx, kube, "node-a", key, corev1.TaintEffectNoSchedule)
	if err != nil || !removed {
		t.Fatalf("removeTaint: %v %v", removed, err)
	}
	n, err := kube.CoreV1().Nodes().Get(ctx, "node-a", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	want := []corev1.Taint{other, {Key: key, Effect: corev1.TaintEffectNoExecute}}
	if !slices.EqualFunc(n.Spec.Taints, want, func(a, b corev1.Taint) bool { return a.MatchTaint(&b) }) {
		t.Errorf("taints after removal: %v, want %v", n.Spec.Taints, want)
	}
	// Again: nothing to do.
	if removed, err := removeTaint(ctx, kube, "node-a", key, corev1.TaintEffectNoSchedule); err != nil || removed {
		t.Errorf("second removeTaint: %v %v, want nothing removed", removed, err)
	}
	if _, err := removeTaint(ctx, kube, "node-x", key, corev1.TaintEffectNoSchedule); err == nil {
		t.Error("removeTaint of a missing node: no error")
	}
}

func TestReadyTaintNeedsKubernetes(t *testing.T) {
	err := registerTaintRemoval(taintParams{Config: Config{ReadyTaint: "k:NoSchedule"}})
	if !errors.Is(err, ErrTaintNeedsKubernetes) {
		t.Errorf("--ready-taint without Kubernetes: %v", err)
	}
	if err := registerTaintRemoval(taintParams{Config: Config{ReadyTaint: "k"}}); err == nil {
		t.Error("--ready-taint=k: no error")
	}
}
