// SPDX-License-Identifier: Apache-2.0

package deploy_test

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"

	"github.com/mtlsbridge/mtlsbridge/agent"
	"github.com/mtlsbridge/mtlsbridge/internal/kubetest"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/enrollment"
)

// authModeAnnotation is the policy annotation that carries the
// authentication requirement where Cilium's schema no longer has the field
// (README "Enrollment rules", rule 2).
const authModeAnnotation = "mtlsbridge.io/authentication-mode"

// TestCNPSchemaWithoutAuthentication runs on Cilium's CRDs with the
// `authentication` field removed, as planned upstream: the API server
// prunes the field from a policy that sets it, so a policy's requirement
// can only reach mtlsbridge through the annotation.
func TestCNPSchemaWithoutAuthentication(t *testing.T) {
	cfg := kubetest.Start(t)
	kubetest.ApplyCiliumCRDsWithout(t, cfg, "authentication")
	kube := kubernetes.NewForConfigOrDie(cfg)
	dyn := dynamic.NewForConfigOrDie(cfg)
	ctx := t.Context()

	_, err := kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "app"}}, metav1.CreateOptions{})
	must(t, err)
	kubetest.CreateRunningPod(t, kube, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "web", Namespace: "app", Labels: map[string]string{"app": "web"}},
		Spec:       corev1.PodSpec{NodeName: "node-a"},
	}, "10.0.1.1")
	cnp := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "cilium.io/v2", "kind": "CiliumNetworkPolicy",
		"metadata": map[string]any{"name": "web-mtls", "namespace": "app",
			"annotations": map[string]any{authModeAnnotation: "required"}},
		"spec": map[string]any{
			"endpointSelector": map[string]any{"matchLabels": map[string]any{"app": "web"}},
			"ingress": []any{map[string]any{
				"fromEndpoints":  []any{map[string]any{"matchLabels": map[string]any{"app": "client"}}},
				"authentication": map[string]any{"mode": "required"},
			}},
		},
	}}
	_, err = dyn.Resource(kubetest.CNPResource).Namespace("app").Create(ctx, cnp, metav1.CreateOptions{})
	must(t, err)

	// Stored without the field; the rest of the rule and the annotation stay.
	got, err := dyn.Resource(kubetest.CNPResource).Namespace("app").Get(ctx, "web-mtls", metav1.GetOptions{})
	must(t, err)
	ingress, _, _ := unstructured.NestedSlice(got.Object, "spec", "ingress")
	if len(ingress) != 1 {
		t.Fatalf("spec.ingress: %v", ingress)
	}
	rule := ingress[0].(map[string]any)
	if _, ok := rule["authentication"]; ok {
		t.Errorf("the API server kept spec.ingress[0].authentication: %v", rule)
	}
	if _, ok := rule["fromEndpoints"]; !ok {
		t.Errorf("the API server pruned more than authentication: %v", rule)
	}
	if got.GetAnnotations()[authModeAnnotation] != "required" {
		t.Errorf("annotations %v", got.GetAnnotations())
	}

	t.Run("enrolled by the annotation", func(t *testing.T) {
		var (
			db          *statedb.DB
			enrollments statedb.Table[*enrollment.Enrollment]
		)
		h := hive.New(agent.Infrastructure, agent.Cell, cell.Invoke(func(d *statedb.DB, e statedb.Table[*enrollment.Enrollment]) {
			db, enrollments = d, e
		}))
		stateDir, err := os.MkdirTemp("", "mtlsb-")
		must(t, err)
		t.Cleanup(func() { os.RemoveAll(stateDir) })
		flags := pflag.NewFlagSet("", pflag.ContinueOnError)
		h.RegisterFlags(flags)
		must(t, flags.Parse([]string{"--source=k8s", "--kubeconfig=" + kubetest.WriteKubeconfig(t, cfg), "--state-dir=" + stateDir,
			"--node-name=node-a", "--grpc-listen=127.0.0.1:0", "--enable-redirect=false"}))
		log := hivetest.Logger(t)
		startCtx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		must(t, h.Start(log, startCtx))
		t.Cleanup(func() { h.Stop(log, context.Background()) })

		deadline := time.After(30 * time.Second)
		for {
			e, _, found := enrollments.Get(db.ReadTxn(), enrollment.ByKey("app/web"))
			if found && e.Enrolled && e.Reason == "policy:cnp/app/web-mtls" {
				return
			}
			_, watch := enrollments.AllWatch(db.ReadTxn())
			select {
			case <-watch:
			case <-deadline:
				t.Fatalf("app/web not enrolled by the annotated policy: %+v", e)
			}
		}
	})
}
