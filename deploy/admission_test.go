// SPDX-License-Identifier: Apache-2.0

package deploy_test

import (
	"context"
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	authnv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/mtlsbridge/mtlsbridge/internal/kubetest"
)

const (
	readyTaint      = "mtlsbridge.io/agent-not-ready"
	redirAnnotation = "mtlsbridge.io/redirect"
	nodeNameExtra   = "authentication.kubernetes.io/node-name"
)

// ciliumPod creates kube-system/cilium-<node>, a pod of Cilium's DaemonSet
// bound to node, running as the ServiceAccount kube-system/cilium.
func ciliumPod(t *testing.T, kube kubernetes.Interface, node string) *corev1.Pod {
	t.Helper()
	return kubetest.CreateRunningPod(t, kube, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "cilium-" + node, Namespace: ciliumNS, Labels: map[string]string{"k8s-app": "cilium"}},
		Spec:       corev1.PodSpec{NodeName: node, ServiceAccountName: ciliumAccount, HostNetwork: true},
	}, "192.0.2.1")
}

// tokenConfig is a client configuration authenticated only by a token of
// the ServiceAccount kube-system/cilium from the TokenRequest API: bound to
// pod (as the kubelet's projected tokens are), or to nothing when pod is nil.
func tokenConfig(t *testing.T, admin *rest.Config, kube kubernetes.Interface, pod *corev1.Pod) *rest.Config {
	t.Helper()
	req := &authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{ExpirationSeconds: new(int64(3600))}}
	if pod != nil {
		req.Spec.BoundObjectRef = &authnv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID}
	}
	tr, err := kube.CoreV1().ServiceAccounts(ciliumNS).CreateToken(t.Context(), ciliumAccount, req, metav1.CreateOptions{})
	must(t, err)
	return &rest.Config{
		Host:            admin.Host,
		BearerToken:     tr.Status.Token,
		TLSClientConfig: rest.TLSClientConfig{CAData: admin.CAData},
		QPS:             50, Burst: 100,
	}
}

// installShipped creates the ServiceAccount and applies the shipped RBAC
// and admission policy for real.
func installShipped(t *testing.T, cfg *rest.Config, kube kubernetes.Interface, files ...string) {
	t.Helper()
	_, err := kube.CoreV1().ServiceAccounts(ciliumNS).Create(t.Context(),
		&corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: ciliumAccount}}, metav1.CreateOptions{})
	must(t, err)
	a := newApplier(t, cfg)
	for _, f := range files {
		for _, obj := range readFile(t, f) {
			if err := a.apply(t, obj, false); err != nil {
				t.Fatalf("%s: %s %s: %v", f, obj.GetKind(), obj.GetName(), err)
			}
		}
	}
}

// TestAdmissionPolicy runs the shipped ValidatingAdmissionPolicy on a real
// API server: mtlsbridge's identity (kube-system/cilium with a token bound
// to the Cilium pod of node-a) may set or remove its annotation on pods of
// node-a and remove its taint from node-a, and nothing else that RBAC lets
// it patch or update; no other identity may change that annotation.
func TestAdmissionPolicy(t *testing.T) {
	cfg := kubetest.Start(t)
	kubetest.ApplyCiliumCRDs(t, cfg)
	kube := kubernetes.NewForConfigOrDie(cfg)
	ctx := t.Context()

	for _, node := range []string{"node-a", "node-b"} {
		_, err := kube.CoreV1().Nodes().Create(ctx, &corev1.Node{
			ObjectMeta: metav1.ObjectMeta{Name: node, Labels: map[string]string{"kubernetes.io/hostname": node}},
			Spec: corev1.NodeSpec{Taints: []corev1.Taint{
				{Key: readyTaint, Effect: corev1.TaintEffectNoSchedule},
				{Key: "example.com/other", Effect: corev1.TaintEffectNoSchedule},
			}},
		}, metav1.CreateOptions{})
		must(t, err)
	}
	installShipped(t, cfg, kube, "kubernetes/mtlsbridge-rbac.yaml", "kubernetes/mtlsbridge-admission-policy.yaml")
	_, err := kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "app"}}, metav1.CreateOptions{})
	must(t, err)
	for _, node := range []string{"node-a", "node-b"} {
		kubetest.CreateRunningPod(t, kube, &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: "web-" + node, Namespace: "app", Labels: map[string]string{"app": "web"},
				Annotations: map[string]string{"example.com/keep": "1"}},
			Spec: corev1.PodSpec{NodeName: node},
		}, "10.0.0.1")
	}

	agentCfg := tokenConfig(t, cfg, kube, ciliumPod(t, kube, "node-a"))
	agentKube := kubernetes.NewForConfigOrDie(agentCfg)

	// The premise: the pod-bound token names the pod's node.
	review, err := agentKube.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authnv1.SelfSubjectReview{}, metav1.CreateOptions{})
	must(t, err)
	if got := review.Status.UserInfo.Extra[nodeNameExtra]; !slices.Equal(got, authnv1.ExtraValue{"node-a"}) {
		t.Fatalf("the pod-bound token's %s is %v, want [node-a]", nodeNameExtra, got)
	}

	patchPod := func(c kubernetes.Interface, pod string, dryRun bool, patch map[string]any) error {
		data, err := json.Marshal(patch)
		must(t, err)
		opts := metav1.PatchOptions{}
		if dryRun {
			opts.DryRun = []string{metav1.DryRunAll}
		}
		_, err = c.CoreV1().Pods("app").Patch(ctx, pod, types.MergePatchType, data, opts)
		return err
	}
	annotate := func(value any) map[string]any {
		return map[string]any{"metadata": map[string]any{"annotations": map[string]any{redirAnnotation: value}}}
	}

	// The API server loads policies in the background: wait until a write
	// the policy forbids is refused (as a dry run, which changes nothing
	// whether refused or not).
	deadline := time.Now().Add(30 * time.Second)
	relabel := map[string]any{"metadata": map[string]any{"labels": map[string]any{"app": "evil"}}}
	for patchPod(agentKube, "web-node-a", true, relabel) == nil {
		if time.Now().After(deadline) {
			t.Fatal("the admission policy never took effect")
		}
		time.Sleep(100 * time.Millisecond)
	}

	denied := func(what string, err error, wantMessage string) {
		t.Helper()
		if !apierrors.IsForbidden(err) && !apierrors.IsInvalid(err) {
			t.Errorf("%s: got %v, want refused by the admission policy", what, err)
			return
		}
		if !strings.Contains(err.Error(), "mtlsbridge-node-scope") || !strings.Contains(err.Error(), wantMessage) {
			t.Errorf("%s: refused with %q, want the policy's message %q", what, err, wantMessage)
		}
	}
	allowed := func(what string, err error) {
		t.Helper()
		if err != nil {
			t.Errorf("%s: %v", what, err)
		}
	}

	// Pods.
	allowed("annotate a pod of its node", patchPod(agentKube, "web-node-a", false, annotate("ready")))
	allowed("remove the annotation again", patchPod(agentKube, "web-node-a", false, annotate(nil)))
	denied("annotate a pod of another node", patchPod(agentKube, "web-node-b", false, annotate("ready")),
		"may annotate only pods of its own node")
	denied("another value", patchPod(agentKube, "web-node-a", false, annotate("yes")),
		"may change only the annotation mtlsbridge.io/redirect")
	denied("another annotation", patchPod(agentKube, "web-node-a", false,
		map[string]any{"metadata": map[string]any{"annotations": map[string]any{"example.com/new": "x"}}}),
		"may change only the annotation mtlsbridge.io/redirect")
	denied("remove another annotation", patchPod(agentKube, "web-node-a", false,
		map[string]any{"metadata": map[string]any{"annotations": map[string]any{"example.com/keep": nil}}}),
		"may change only the annotation mtlsbridge.io/redirect")
	denied("a label", patchPod(agentKube, "web-node-a", false, relabel),
		"may change only the annotation mtlsbridge.io/redirect")
	denied("the spec", patchPod(agentKube, "web-node-a", false,
		map[string]any{"spec": map[string]any{"activeDeadlineSeconds": 5}}),
		"may change only the annotation mtlsbridge.io/redirect")
	denied("a finalizer", patchPod(agentKube, "web-node-a", false,
		map[string]any{"metadata": map[string]any{"finalizers": []any{"example.com/hold"}}}),
		"may change only the annotation mtlsbridge.io/redirect")

	// Nodes: the agent reads the node and writes it back whole.
	updateNode := func(c kubernetes.Interface, node string, change func(*corev1.Node)) error {
		n, err := c.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
		if err != nil {
			return err
		}
		change(n)
		_, err = c.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{})
		return err
	}
	dropTaint := func(key string) func(*corev1.Node) {
		return func(n *corev1.Node) {
			n.Spec.Taints = slices.DeleteFunc(n.Spec.Taints, func(t corev1.Taint) bool { return t.Key == key })
		}
	}
	denied("remove its taint from another node", updateNode(agentKube, "node-b", dropTaint(readyTaint)),
		"may change only its own node")
	denied("remove another taint", updateNode(agentKube, "node-a", dropTaint("example.com/other")),
		"may only remove the taint mtlsbridge.io/agent-not-ready")
	denied("add a taint", updateNode(agentKube, "node-a", func(n *corev1.Node) {
		n.Spec.Taints = append(n.Spec.Taints, corev1.Taint{Key: "example.com/new", Effect: corev1.TaintEffectNoSchedule})
	}), "may only remove the taint mtlsbridge.io/agent-not-ready")
	denied("cordon", updateNode(agentKube, "node-a", func(n *corev1.Node) { n.Spec.Unschedulable = true }),
		"may only remove the taint mtlsbridge.io/agent-not-ready")
	denied("relabel", updateNode(agentKube, "node-a", func(n *corev1.Node) { n.Labels["example.com/role"] = "x" }),
		"may only remove the taint mtlsbridge.io/agent-not-ready")
	allowed("remove its taint from its node", updateNode(agentKube, "node-a", dropTaint(readyTaint)))
	n, err := kube.CoreV1().Nodes().Get(ctx, "node-a", metav1.GetOptions{})
	must(t, err)
	hasTaint := func(key string) bool {
		return slices.ContainsFunc(n.Spec.Taints, func(t corev1.Taint) bool { return t.Key == key })
	}
	if hasTaint(readyTaint) || !hasTaint("example.com/other") {
		t.Errorf("node-a's taints after the agent's update: %v", n.Spec.Taints)
	}

	// The same account with a token bound to no pod names no node: every
	// write is refused.
	unbound := kubernetes.NewForConfigOrDie(tokenConfig(t, cfg, kube, nil))
	denied("a token bound to no pod", patchPod(unbound, "web-node-a", false, annotate("ready")),
		"the caller's token names no node")

	// Other identities are not this policy's business.
	allowed("an administrator relabels a pod", patchPod(kube, "web-node-b", false,
		map[string]any{"metadata": map[string]any{"labels": map[string]any{"app": "other"}}}))

	// But no other identity touches mtlsbridge's annotation: removed by a
	// workload owner, peers would send to the pod in clear.
	allowed("annotate a pod of its node", patchPod(agentKube, "web-node-a", false, annotate("ready")))
	for deadline := time.Now().Add(30 * time.Second); patchPod(kube, "web-node-a", true, annotate(nil)) == nil; {
		if time.Now().After(deadline) {
			t.Fatal("the annotation's admission policy never took effect")
		}
		time.Sleep(100 * time.Millisecond)
	}
	protected := func(what string, err error) {
		t.Helper()
		const message = "only mtlsbridge (kube-system/cilium) may set, change or remove the annotation mtlsbridge.io/redirect"
		if !apierrors.IsForbidden(err) && !apierrors.IsInvalid(err) {
			t.Errorf("%s: got %v, want refused by the admission policy", what, err)
		} else if !strings.Contains(err.Error(), "mtlsbridge-redirect-annotation") || !strings.Contains(err.Error(), message) {
			t.Errorf("%s: refused with %q, want the policy's message %q", what, err, message)
		}
	}
	protected("another identity removes the annotation", patchPod(kube, "web-node-a", false, annotate(nil)))
	protected("another identity changes it", patchPod(kube, "web-node-a", false, annotate("no")))
	protected("another identity sets it", patchPod(kube, "web-node-b", false, annotate("ready")))
	data, err := json.Marshal(annotate(nil))
	must(t, err)
	_, err = kube.CoreV1().Pods("app").Patch(ctx, "web-node-a", types.MergePatchType, data, metav1.PatchOptions{}, "status")
	protected("another identity removes it through the pod's status", err)
	_, err = kube.CoreV1().Pods("app").Patch(ctx, "web-node-a", types.MergePatchType,
		[]byte(`{"status":{"message":"still running"}}`), metav1.PatchOptions{}, "status")
	allowed("another identity writes the status of an annotated pod", err)
	allowed("another identity relabels an annotated pod", patchPod(kube, "web-node-a", false,
		map[string]any{"metadata": map[string]any{"labels": map[string]any{"app": "other"}}}))
	allowed("mtlsbridge removes it", patchPod(agentKube, "web-node-a", false, annotate(nil)))
	allowed("an administrator removes the taint of node-b", updateNode(kube, "node-b", dropTaint(readyTaint)))

	// The policy narrows RBAC; it grants nothing: a verb the ClusterRole
	// lacks stays forbidden by RBAC.
	if err := agentKube.CoreV1().Pods("app").Delete(context.Background(), "web-node-a", metav1.DeleteOptions{}); !apierrors.IsForbidden(err) {
		t.Errorf("deleting a pod as mtlsbridge: got %v, want forbidden", err)
	}
}
