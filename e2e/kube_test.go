// SPDX-License-Identifier: Apache-2.0

package e2e_test

import (
	"context"
	"net/url"
	"testing"

	authnv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/retry"

	"github.com/mtlsbridge/mtlsbridge/internal/kubetest"
	"github.com/mtlsbridge/mtlsbridge/internal/netnstest"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// TestMTLSKubernetes runs the checks of TestMTLS with both node agents
// watching one real kube-apiserver: the test writes nodes, namespaces and
// pods as an operator and a kubelet would (a pod's addresses once its CNI
// ADD returned), the proxies authenticate with bound service account
// tokens from the TokenRequest API (audience istio-ca) that the agents
// check with TokenReview, and each agent publishes
// mtlsbridge.io/redirect: ready on its redirected pods, which the other
// node's agent reads to tell its proxy to use HBONE.
func TestMTLSKubernetes(t *testing.T) {
	netnstest.RequirePrivileged(t)
	b := newBed(t, newKubeCluster(t))
	runChecks(t, b, nil)
}

// kubeCluster is a kube-apiserver of the test (internal/kubetest). It
// listens on the root namespace's loopback; a relay inside each node's
// namespace, on the node's loopback at the same port, makes it reachable
// to the agents there as one apiserver address, and carries its traffic
// over loopback only.
type kubeCluster struct {
	t          testing.TB
	server     *kubetest.Server
	kube       kubernetes.Interface
	host       string
	kubeconfig string
}

func newKubeCluster(t testing.TB) *kubeCluster {
	srv := kubetest.StartServer(t, kubetest.Options{})
	cfg := srv.Config
	kubetest.ApplyCiliumCRDs(t, cfg)
	u, err := url.Parse(cfg.Host)
	must(t, err)
	return &kubeCluster{t: t, server: srv, kube: kubernetes.NewForConfigOrDie(cfg), host: u.Host, kubeconfig: kubetest.WriteKubeconfig(t, cfg)}
}

func (c *kubeCluster) init(b *bed) {
	ctx := context.Background()
	for _, n := range b.nodes {
		n.ns.Relay(c.t, c.host, c.host)
		node, err := c.kube.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n.name}}, metav1.CreateOptions{})
		must(c.t, err)
		node.Status.Addresses = []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: n.ns.Addr4.String()}}
		_, err = c.kube.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{})
		must(c.t, err)
	}
	for _, ns := range []string{"app", "kube-system"} {
		_, err := c.kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{})
		if err != nil && !apierrors.IsAlreadyExists(err) {
			c.t.Fatal(err)
		}
	}
	// No controller-manager creates service accounts: the proxies' is made
	// here, for TokenRequest.
	_, err := c.kube.CoreV1().ServiceAccounts("kube-system").Create(ctx,
		&corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "ztunnel"}}, metav1.CreateOptions{})
	must(c.t, err)
}

func (c *kubeCluster) agentArgs(*bedNode) []string {
	return []string{"--source=k8s", "--kubeconfig=" + c.kubeconfig}
}

func (c *kubeCluster) putPod(p *bedPod) {
	ctx := context.Background()
	pods := c.kube.CoreV1().Pods(p.namespace)
	setLabels := func(pod *corev1.Pod) {
		if pod.Labels == nil {
			pod.Labels = map[string]string{}
		}
		delete(pod.Labels, tables.RedirTypeLabel)
		switch {
		case p.isProxy:
			pod.Labels[tables.RedirTypeLabel] = tables.RedirTypeProxy
		case p.enrolled:
			pod.Labels[tables.RedirTypeLabel] = tables.RedirTypeWorkload
		}
	}
	if !p.created {
		pod := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: p.name, Namespace: p.namespace},
			Spec: corev1.PodSpec{NodeName: p.node.name, ServiceAccountName: p.serviceAccount,
				Containers: []corev1.Container{{Name: "main", Image: "registry.invalid/none"}}},
		}
		setLabels(pod)
		created, err := pods.Create(ctx, pod, metav1.CreateOptions{})
		must(c.t, err)
		p.sb.UID, p.created = string(created.UID), true
		return
	}
	// The agents annotate pods meanwhile: update on the latest version.
	must(c.t, retry.RetryOnConflict(retry.DefaultRetry, func() error {
		pod, err := pods.Get(ctx, p.name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		setLabels(pod)
		if pod, err = pods.Update(ctx, pod, metav1.UpdateOptions{}); err != nil {
			return err
		}
		if !p.running || pod.Status.Phase == corev1.PodRunning {
			return nil
		}
		pod.Status = corev1.PodStatus{Phase: corev1.PodRunning, PodIP: p.ip4.String(),
			PodIPs: []corev1.PodIP{{IP: p.ip4.String()}, {IP: p.ip6.String()}}}
		_, err = pods.UpdateStatus(ctx, pod, metav1.UpdateOptions{})
		return err
	}))
}

func (c *kubeCluster) deletePod(p *bedPod) {
	now := int64(0)
	must(c.t, c.kube.CoreV1().Pods(p.namespace).Delete(context.Background(), p.name, metav1.DeleteOptions{GracePeriodSeconds: &now}))
}

// token asks the TokenRequest API for a token bound to the proxy's pod,
// for the audience the agents review it with, as the kubelet projects it.
func (c *kubeCluster) token(p *bedPod) string {
	expiry := int64(3600)
	tr, err := c.kube.CoreV1().ServiceAccounts(p.namespace).CreateToken(context.Background(), p.serviceAccount, &authnv1.TokenRequest{
		Spec: authnv1.TokenRequestSpec{
			Audiences:         []string{"istio-ca"},
			ExpirationSeconds: &expiry,
			BoundObjectRef:    &authnv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: p.name, UID: types.UID(p.sb.UID)},
		},
	}, metav1.CreateOptions{})
	must(c.t, err)
	return tr.Status.Token
}
