// SPDX-License-Identifier: Apache-2.0

package deploy_test

import (
	"encoding/json"
	"fmt"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"

	"github.com/mtlsbridge/mtlsbridge/internal/kubetest"
)

// applier applies objects to an API server with server-side apply.
type applier struct {
	dyn    dynamic.Interface
	mapper *restmapper.DeferredDiscoveryRESTMapper
}

func newApplier(t *testing.T, cfg *rest.Config) *applier {
	t.Helper()
	dc, err := discovery.NewDiscoveryClientForConfig(cfg)
	must(t, err)
	return &applier{
		dyn:    dynamic.NewForConfigOrDie(cfg),
		mapper: restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(dc)),
	}
}

// apply server-side applies obj. With dryRun, the server validates and
// admits it completely (schemas, CEL rules, admission) but stores nothing.
// Field validation is Strict: an unknown or duplicate field is an error,
// not a warning.
func (a *applier) apply(t *testing.T, obj *unstructured.Unstructured, dryRun bool) error {
	t.Helper()
	gvk := obj.GroupVersionKind()
	m, err := a.mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
	if err != nil {
		a.mapper.Reset() // a CRD applied since the last discovery
		if m, err = a.mapper.RESTMapping(gvk.GroupKind(), gvk.Version); err != nil {
			return fmt.Errorf("%s: %w", gvk, err)
		}
	}
	var res dynamic.ResourceInterface = a.dyn.Resource(m.Resource)
	if m.Scope.Name() == "namespace" {
		ns := obj.GetNamespace()
		if ns == "" {
			ns = ciliumNS
		}
		res = a.dyn.Resource(m.Resource).Namespace(ns)
	}
	data, err := json.Marshal(obj.Object)
	if err != nil {
		return err
	}
	opts := metav1.PatchOptions{FieldManager: "deploy-test", Force: new(true), FieldValidation: "Strict"}
	if dryRun {
		opts.DryRun = []string{metav1.DryRunAll}
	}
	_, err = res.Patch(t.Context(), obj.GetName(), types.ApplyPatchType, data, opts)
	return err
}

// TestApplyToAPIServer applies everything an operator installs (Cilium's
// chart rendered with each mode's values, each mode's mTLS agent, and
// deploy/kubernetes) to a real kube-apiserver that has Cilium's CRDs, with
// server-side dry-run: any object the API server would refuse fails the
// test.
func TestApplyToAPIServer(t *testing.T) {
	cfg := kubetest.Start(t)
	kubetest.ApplyCiliumCRDs(t, cfg)
	a := newApplier(t, cfg)

	objs := append(renderCilium(t, l2Values), readManifests(t)...)
	objs = append(objs, readFile(t, l2Agent)...)
	// The in-pod mode's DaemonSet replaces the l2 one (a dry run stores
	// nothing: both are checked).
	objs = append(objs, renderCilium(t, inpodValues)...)
	objs = append(objs, readFile(t, inpodAgent)...)
	objs = append(objs, readFile(t, "optional/mtlsbridge-ca-secret-rbac.yaml")...)
	objs = append(objs, readFile(t, "optional/mtlsbridge-mtls-agent-ingress.yaml")...)
	objs = append(objs, readFile(t, "optional/mtlsbridge-probe-snat-ingress.yaml")...)
	// Namespaces for real, as Helm creates them first: a dry run stores
	// nothing, and the objects inside would find no namespace.
	for _, obj := range objs {
		if obj.GetKind() == "Namespace" {
			must(t, a.apply(t, obj, false))
		}
	}
	kinds := map[string]int{}
	for _, obj := range objs {
		if err := a.apply(t, obj, true); err != nil {
			t.Errorf("%s %s/%s: %v", obj.GetKind(), obj.GetNamespace(), obj.GetName(), err)
		}
		kinds[obj.GetKind()]++
	}
	t.Logf("applied (dry run) %d objects: %v", len(objs), kinds)
	for _, kind := range []string{"DaemonSet", "ConfigMap", "ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"} {
		if kinds[kind] == 0 {
			t.Errorf("nothing of kind %s was applied", kind)
		}
	}

	// The check has teeth: the same DaemonSet with a misspelt field of the
	// sidecar is refused.
	ds := find(t, objs, "DaemonSet", "cilium").DeepCopy()
	containers, _, _ := unstructured.NestedSlice(ds.Object, "spec", "template", "spec", "containers")
	for i, c := range containers {
		if c.(map[string]any)["name"] == sidecarName {
			containers[i].(map[string]any)["volumeMount"] = []any{}
		}
	}
	must(t, unstructured.SetNestedSlice(ds.Object, containers, "spec", "template", "spec", "containers"))
	if err := a.apply(t, ds, true); err == nil {
		t.Error("a DaemonSet whose sidecar has an unknown field was accepted")
	}
}
