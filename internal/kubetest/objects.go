// SPDX-License-Identifier: Apache-2.0

package kubetest

import (
	"net/netip"
	"path/filepath"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// WriteKubeconfig writes cfg as a kubeconfig file, so that a test configures
// the agent the way an operator does (--kubeconfig).
func WriteKubeconfig(t testing.TB, cfg *rest.Config) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "kubeconfig")
	kc := clientcmdapi.NewConfig()
	kc.Clusters["test"] = &clientcmdapi.Cluster{Server: cfg.Host, CertificateAuthorityData: cfg.CAData}
	kc.AuthInfos["admin"] = &clientcmdapi.AuthInfo{Token: cfg.BearerToken}
	kc.Contexts["test"] = &clientcmdapi.Context{Cluster: "test", AuthInfo: "admin"}
	kc.CurrentContext = "test"
	if err := clientcmd.WriteToFile(*kc, path); err != nil {
		t.Fatalf("kubetest: %v", err)
	}
	return path
}

// CreateRunningPod creates a pod (bound to its spec's node; a placeholder
// container when it has none) and gives it the status a kubelet would:
// Running with the addresses ips. No kubelet runs with this API server.
func CreateRunningPod(t testing.TB, kube kubernetes.Interface, pod *corev1.Pod, ips ...string) *corev1.Pod {
	t.Helper()
	if len(pod.Spec.Containers) == 0 {
		pod.Spec.Containers = []corev1.Container{{Name: "main", Image: "registry.invalid/none"}}
	}
	created, err := kube.CoreV1().Pods(pod.Namespace).Create(t.Context(), pod, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("kubetest: create pod %s/%s: %v", pod.Namespace, pod.Name, err)
	}
	created.Status = corev1.PodStatus{Phase: corev1.PodRunning}
	for _, ip := range ips {
		created.Status.PodIPs = append(created.Status.PodIPs, corev1.PodIP{IP: ip})
	}
	if len(ips) > 0 {
		created.Status.PodIP = ips[0]
	}
	updated, err := kube.CoreV1().Pods(pod.Namespace).UpdateStatus(t.Context(), created, metav1.UpdateOptions{})
	if err != nil {
		t.Fatalf("kubetest: status of pod %s/%s: %v", pod.Namespace, pod.Name, err)
	}
	return updated
}

// CreatePod is CreateRunningPod for the common case: pod ns/name on node,
// with labels and addresses ips.
func CreatePod(t testing.TB, kube kubernetes.Interface, ns, name, node string, labels map[string]string, ips ...netip.Addr) *corev1.Pod {
	t.Helper()
	addrs := make([]string, len(ips))
	for i, ip := range ips {
		addrs[i] = ip.String()
	}
	return CreateRunningPod(t, kube, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: labels},
		Spec:       corev1.PodSpec{NodeName: node},
	}, addrs...)
}
