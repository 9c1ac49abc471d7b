// SPDX-License-Identifier: Apache-2.0

package redirect_test

import (
	"testing"
	"time"

	"github.com/cilium/statedb"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/mtlsbridge/mtlsbridge/internal/kubetest"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// TestPublishReady runs the agent against a real kube-apiserver: once pod
// a's redirection is in place, a carries mtlsbridge.io/redirect=ready
// (and the pods table, fed back from the API, says so), also after
// someone removed it; pods that are not redirected carry nothing;
// unenrolling a removes the annotation.
func TestPublishReady(t *testing.T) {
	c := newCluster(t)
	cfg := kubetest.Start(t)
	kubetest.ApplyCiliumCRDs(t, cfg)
	kube := kubernetes.NewForConfigOrDie(cfg)
	ctx := t.Context()

	_, err := kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "app"}}, metav1.CreateOptions{})
	must(t, err)
	workload := map[string]string{tables.RedirTypeLabel: tables.RedirTypeWorkload}
	kubetest.CreatePod(t, kube, "kube-system", "ztunnel", "node-a", map[string]string{tables.RedirTypeLabel: tables.RedirTypeProxy}, c.agent.IP4, c.agent.IP6)
	kubetest.CreatePod(t, kube, "app", "a", "node-a", workload, c.a.IP4, c.a.IP6)
	kubetest.CreatePod(t, kube, "app", "n", "node-a", nil, c.n.IP4, c.n.IP6)
	kubetest.CreatePod(t, kube, "app", "ghost", "node-a", workload, ghostIP)
	kubetest.CreatePod(t, kube, "app", "r", "node-b", workload, c.r.IP4, c.r.IP6)

	ag := c.startAgent(t, "--source=k8s", "--kubeconfig="+kubetest.WriteKubeconfig(t, cfg))
	podReady := func(txn statedb.ReadTxn, name string) bool {
		pod, _, ok := ag.pods.Get(txn, tables.PodByKey("app/"+name))
		return ok && pod.RedirectReady
	}

	annotation := func(name string) string {
		pod, err := kube.CoreV1().Pods("app").Get(ctx, name, metav1.GetOptions{})
		must(t, err)
		return pod.Annotations[tables.RedirectAnnotation]
	}
	waitAnnotation := func(name, want string) {
		t.Helper()
		deadline := time.Now().Add(waitTimeout)
		for annotation(name) != want {
			if time.Now().After(deadline) {
				t.Fatalf("annotation of %s: %q, want %q; tables:\n%s", name, annotation(name), want, ag.dump(ag.db.ReadTxn()))
			}
			time.Sleep(100 * time.Millisecond)
		}
	}

	// Step 1: a is redirected, and says so; the others do not.
	waitAnnotation("a", tables.RedirectReadyValue)
	ag.waitFor(t, "the pods table to show a as redirected", func(txn statedb.ReadTxn) bool { return podReady(txn, "a") })
	for _, name := range []string{"n", "ghost", "r"} {
		if got := annotation(name); got != "" {
			t.Errorf("annotation of %s: %q, want none", name, got)
		}
	}
	if ans := ask(t, c.a, c.r.IP4, 8080); ans.Server != "agent" {
		t.Errorf("a -> r answered by %s", ans)
	}

	// Step 2: someone else removes a's annotation (an identity the
	// admission policy does not stop, or a cluster without it): peers
	// would send to a in clear. The agent puts it back.
	patch := []byte(`{"metadata":{"annotations":{"` + tables.RedirectAnnotation + `":null}}}`)
	_, err = kube.CoreV1().Pods("app").Patch(ctx, "a", types.MergePatchType, patch, metav1.PatchOptions{})
	must(t, err)
	waitAnnotation("a", tables.RedirectReadyValue)

	// Step 3: a is unenrolled; the annotation goes.
	a, err := kube.CoreV1().Pods("app").Get(ctx, "a", metav1.GetOptions{})
	must(t, err)
	a.Labels = nil
	_, err = kube.CoreV1().Pods("app").Update(ctx, a, metav1.UpdateOptions{})
	must(t, err)
	waitAnnotation("a", "")
	ag.waitFor(t, "the pods table to show a as not redirected", func(txn statedb.ReadTxn) bool { return !podReady(txn, "a") })
	if ans := ask(t, c.a, c.r.IP4, 8080); ans.Server != "r" {
		t.Errorf("a -> r after unenrolling answered by %s", ans)
	}
}

// createPod creates a running pod in namespace app.
