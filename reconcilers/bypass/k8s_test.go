// SPDX-License-Identifier: Apache-2.0

package bypass_test

import (
	"net/netip"
	"path/filepath"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/mtlsbridge/mtlsbridge/internal/kubetest"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/bypass"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/enrollment"
)

// TestReadyTaint: a node provisioned with the taint keeps it while an
// enrolled pod of the node is not redirected (no mTLS agent pod yet), and
// loses it once the agent is ready.
func TestReadyTaint(t *testing.T) {
	nd := newNode(t)
	cfg := kubetest.Start(t)
	kubetest.ApplyCRDs(t, cfg, "../../testdata/crds")
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
	createPod(t, kube, "a", map[string]string{enrollment.RedirTypeLabel: enrollment.RedirTypeWorkload}, nd.a.IP4, nd.a.IP6)

	ag := nd.startAgent(t, "--source=k8s", "--kubeconfig="+writeKubeconfig(t, cfg), "--ready-taint="+taintKey+":NoSchedule")
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
	createPod(t, kube, "ztunnel", map[string]string{enrollment.RedirTypeLabel: enrollment.RedirTypeProxy}, nd.agent.IP4, nd.agent.IP6)
	deadline := time.Now().Add(waitTimeout)
	for tainted() {
		if time.Now().After(deadline) {
			t.Fatal("taint still on node-a after the agent became ready")
		}
		time.Sleep(100 * time.Millisecond)
	}
	ag.waitClean(t, "app/a")
}

// createPod creates a pod on node-a with the status a kubelet would give
// it (no kubelet runs here).
func createPod(t *testing.T, kube kubernetes.Interface, name string, labels map[string]string, ips ...netip.Addr) {
	t.Helper()
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "app", Labels: labels},
		Spec:       corev1.PodSpec{NodeName: "node-a", Containers: []corev1.Container{{Name: "main", Image: "registry.invalid/none"}}},
	}
	created, err := kube.CoreV1().Pods("app").Create(t.Context(), pod, metav1.CreateOptions{})
	must(t, err)
	created.Status = corev1.PodStatus{Phase: corev1.PodRunning, PodIP: ips[0].String()}
	for _, ip := range ips {
		created.Status.PodIPs = append(created.Status.PodIPs, corev1.PodIP{IP: ip.String()})
	}
	_, err = kube.CoreV1().Pods("app").UpdateStatus(t.Context(), created, metav1.UpdateOptions{})
	must(t, err)
}

func writeKubeconfig(t *testing.T, cfg *rest.Config) string {
	path := filepath.Join(t.TempDir(), "kubeconfig")
	kc := clientcmdapi.NewConfig()
	kc.Clusters["test"] = &clientcmdapi.Cluster{Server: cfg.Host, CertificateAuthorityData: cfg.CAData}
	kc.AuthInfos["admin"] = &clientcmdapi.AuthInfo{Token: cfg.BearerToken}
	kc.Contexts["test"] = &clientcmdapi.Context{Cluster: "test", AuthInfo: "admin"}
	kc.CurrentContext = "test"
	must(t, clientcmd.WriteToFile(*kc, path))
	return path
}
