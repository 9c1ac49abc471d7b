// SPDX-License-Identifier: Apache-2.0

package identity

import (
	"crypto/x509"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

// A Secret update that fails leaves the roots ConfigMap ahead (it trusts
// the step's roots, which is harmless) and the Secret as it was, and says
// to run the step again; an update applied whose answer was lost counts as
// done. (The steps themselves run against a real API server in
// cmd/mtlsbridge's TestRotateTheSignersSecret; this is the order of the
// writes when the API server fails between them.)
func TestRotateSecretWhenTheUpdateFails(t *testing.T) {
	certPEM, keyPEM, err := NewRootMaterial("cluster.local", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	first, _ := parseCertificates(certPEM)
	kube := fake.NewClientset(&corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Namespace: "kube-system", Name: "mtlsbridge-ca"},
		Data:       map[string][]byte{CACertFile: certPEM, CAKeyFile: keyPEM},
	})
	var fail func(k8stesting.UpdateAction) error
	kube.PrependReactor("update", "secrets", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if fail == nil {
			return false, nil, nil
		}
		return true, nil, fail(a.(k8stesting.UpdateAction))
	})
	state := func() (secret *corev1.Secret, roots []*x509.Certificate) {
		t.Helper()
		secret, err := kube.CoreV1().Secrets("kube-system").Get(t.Context(), "mtlsbridge-ca", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		cm, err := kube.CoreV1().ConfigMaps("kube-system").Get(t.Context(), "mtlsbridge-ca-roots", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		roots, _ = parseCertificates([]byte(cm.Data[RootsKey]))
		return secret, roots
	}
	rotate := func() (RotationStep, error) {
		return RotateSecret(t.Context(), kube, "kube-system/mtlsbridge-ca", "kube-system/mtlsbridge-ca-roots", "cluster.local")
	}

	fail = func(k8stesting.UpdateAction) error {
		return apierrors.NewConflict(schema.GroupResource{Resource: "secrets"}, "mtlsbridge-ca", errors.New("changed"))
	}
	if _, err := rotate(); err == nil || !strings.Contains(err.Error(), "run the step again") {
		t.Fatalf("the first step with the Secret's update failing: %v, want an error saying to run it again", err)
	}
	secret, roots := state()
	if _, ok := secret.Data[NextCACertFile]; ok || len(roots) != 2 || !roots[0].Equal(first[0]) {
		t.Fatalf("after the failed update: the Secret has a next root: %v; the ConfigMap holds %d roots, want the first and a new one", ok, len(roots))
	}

	// Applied, but the answer lost: done.
	fail = func(a k8stesting.UpdateAction) error {
		if err := kube.Tracker().Update(schema.GroupVersionResource{Version: "v1", Resource: "secrets"}, a.GetObject(), "kube-system"); err != nil {
			return err
		}
		return errors.New("connection reset")
	}
	if step, err := rotate(); err != nil || step != RootTrusted {
		t.Fatalf("the first step, applied but its answer lost: %v, %v", step, err)
	}
	secret, roots = state()
	next, _ := parseCertificates(secret.Data[NextCACertFile])
	if len(next) != 1 || !slices.ContainsFunc(roots, next[0].Equal) {
		t.Fatalf("the Secret's next root is not among the ConfigMap's %d roots", len(roots))
	}
}
