package kubetest_test

import (
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"

	"github.com/mtlsbridge/mtlsbridge/internal/kubetest"
)

func TestStart(t *testing.T) {
	start := time.Now()
	cfg := kubetest.Start(t)
	t.Logf("kube-apiserver ready in %s", time.Since(start).Round(time.Millisecond))
	start = time.Now()
	kubetest.ApplyCiliumCRDs(t, cfg)
	t.Logf("CRDs established in %s", time.Since(start).Round(time.Millisecond))
	// Applying again must be harmless.
	kubetest.ApplyCiliumCRDs(t, cfg)

	ctx := t.Context()
	kube, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}

	version, err := kube.Discovery().ServerVersion()
	if err != nil {
		t.Fatal(err)
	}
	if version.GitVersion != kubetest.KubernetesVersion {
		t.Errorf("server version = %q, want %q", version.GitVersion, kubetest.KubernetesVersion)
	}

	const ns = "kubetest"
	if _, err := kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{
		ObjectMeta: metav1.ObjectMeta{Name: ns},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	// Nothing schedules or runs pods here: this one is only stored.
	if _, err := kube.CoreV1().Pods(ns).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "client", Labels: map[string]string{"app": "client"}},
		Spec: corev1.PodSpec{
			NodeName:   "node-a",
			Containers: []corev1.Container{{Name: "main", Image: "registry.invalid/client:1"}},
		},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pod, err := kube.CoreV1().Pods(ns).Get(ctx, "client", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if pod.Spec.NodeName != "node-a" || pod.Labels["app"] != "client" {
		t.Errorf("pod read back with nodeName %q and labels %v", pod.Spec.NodeName, pod.Labels)
	}

	cnp := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "cilium.io/v2",
		"kind":       "CiliumNetworkPolicy",
		"metadata":   map[string]any{"name": "allow-client"},
		"spec": map[string]any{
			"endpointSelector": map[string]any{
				"matchLabels": map[string]any{"app": "server"},
			},
			"ingress": []any{map[string]any{
				"fromEndpoints": []any{map[string]any{
					"matchLabels": map[string]any{"app": "client"},
				}},
			}},
		},
	}}
	if _, err := dyn.Resource(kubetest.CNPResource).Namespace(ns).Create(ctx, cnp, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	got, err := dyn.Resource(kubetest.CNPResource).Namespace(ns).Get(ctx, "allow-client", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if app, _, _ := unstructured.NestedString(got.Object, "spec", "endpointSelector", "matchLabels", "app"); app != "server" {
		t.Errorf("CiliumNetworkPolicy spec.endpointSelector.matchLabels.app = %q, want server", app)
	}
	ingress, _, _ := unstructured.NestedSlice(got.Object, "spec", "ingress")
	if len(ingress) != 1 {
		t.Errorf("CiliumNetworkPolicy spec.ingress has %d rules, want 1", len(ingress))
	}

	ccnp := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "cilium.io/v2",
		"kind":       "CiliumClusterwideNetworkPolicy",
		"metadata":   map[string]any{"name": "cluster-rule"},
		// Cilium's schema wants one selector and at least one direction
		// in every rule.
		"specs": []any{
			map[string]any{"endpointSelector": map[string]any{}, "ingress": []any{map[string]any{}}},
			map[string]any{"nodeSelector": map[string]any{}, "egress": []any{map[string]any{}}},
		},
	}}
	if _, err := dyn.Resource(kubetest.CCNPResource).Create(ctx, ccnp, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	got, err = dyn.Resource(kubetest.CCNPResource).Get(ctx, "cluster-rule", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if specs, _, _ := unstructured.NestedSlice(got.Object, "specs"); len(specs) != 2 {
		t.Errorf("CiliumClusterwideNetworkPolicy specs has %d rules, want 2", len(specs))
	}

	// Status is written with the object: the CRD has no status subresource.
	cep := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "cilium.io/v2",
		"kind":       "CiliumEndpoint",
		"metadata":   map[string]any{"name": "client"},
		"status": map[string]any{
			"identity": map[string]any{
				"id":     int64(12345),
				"labels": []any{"k8s:app=client"},
			},
			"networking": map[string]any{
				"addressing": []any{map[string]any{"ipv4": "10.1.2.3"}},
				"node":       "192.0.2.10",
			},
		},
	}}
	if _, err := dyn.Resource(kubetest.CEPResource).Namespace(ns).Create(ctx, cep, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	got, err = dyn.Resource(kubetest.CEPResource).Namespace(ns).Get(ctx, "client", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	id, found, err := unstructured.NestedInt64(got.Object, "status", "identity", "id")
	if err != nil || !found || id != 12345 {
		t.Errorf("CiliumEndpoint status.identity.id = %d (found %v, err %v), want 12345", id, found, err)
	}
	if node, _, _ := unstructured.NestedString(got.Object, "status", "networking", "node"); node != "192.0.2.10" {
		t.Errorf("CiliumEndpoint status.networking.node = %q, want 192.0.2.10", node)
	}

	list, err := dyn.Resource(kubetest.CEPResource).Namespace(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(list.Items) != 1 {
		t.Errorf("listed %d CiliumEndpoints, want 1", len(list.Items))
	}
}
