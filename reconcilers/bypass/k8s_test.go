// SPDX-License-Identifier: Apache-2.0

package bypass_test

import (
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/mtlsbridge/mtlsbridge/internal/kubetest"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/bypass"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// TestReadyTaint: a node provisioned with the taint keeps it while an
// enrolled pod of the node is not redirected (no mTLS agent pod yet), and
// loses it once the agent is ready.
func TestReadyTaint(t *testing.T) {
	nd := newNode(t)
	cfg := kubetest.Start(t)
	kubetest.ApplyCiliumCRDs(t, cfg)
	kube := kubernetes.NewForConfigOrDie(cfg)
	ctx := t.Context()
	const taintKey = "mtlsbridge.io/agent-not-ready"

	_, err := kube.CoreV1().Nodes().Create(ctx, &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: "node-a"},
		Spec:       corev1.NodeSpec{Taints: []corev1.Taint{{Key: taintKey, Effect: corev1.TaintEffectNoSchedule}}},
	}, metav1.CreateOptions{})
	must(t, err)
	_, err = kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "app"}}, metav1.CreateOptions{})
	must(t, err)
	kubetest.CreatePod(t, kube, "app", "a", "node-a", map[string]string{tables.RedirTypeLabel: tables.RedirTypeWorkload}, nd.a.IP4, nd.a.IP6)

	ag := nd.startAgent(t, "--source=k8s", "--kubeconfig="+kubetest.WriteKubeconfig(t, cfg), "--ready-taint="+taintKey+":NoSchedule")
	tainted := func() bool {
		n, err := kube.CoreV1().Nodes().Get(ctx, "node-a", metav1.GetOptions{})
		must(t, err)
		return slices.ContainsFunc(n.Spec.Taints, func(tt corev1.Taint) bool { return tt.Key == taintKey })
	}

	// Step 1: not ready (no agent entry): the taint stays.
	ag.waitGap(t, "app/a", bypass.GapAgentMissing)
	time.Sleep(2 * time.Second) // a few checks
	if !tainted() {
		t.Fatal("taint removed before the agent was ready")
	}

	// Step 2: the mTLS agent pod comes; once a is redirected the taint goes.
	kubetest.CreatePod(t, kube, "kube-system", "ztunnel", "node-a", map[string]string{tables.RedirTypeLabel: tables.RedirTypeProxy}, nd.agent.IP4, nd.agent.IP6)
	deadline := time.Now().Add(waitTimeout)
	for tainted() {
		if time.Now().After(deadline) {
			t.Fatal("taint still on node-a after the agent became ready")
		}
		time.Sleep(100 * time.Millisecond)
	}
	ag.waitClean(t, "app/a")
}

// createPod creates a running pod in namespace app.
