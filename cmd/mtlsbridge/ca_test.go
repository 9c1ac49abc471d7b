// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bytes"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/mtlsbridge/mtlsbridge/identity"
	"github.com/mtlsbridge/mtlsbridge/internal/kubetest"
)

// A rotation of the signer's Secret on a real API server: each step
// changes the Secret as it changes a folder, and the nodes' roots
// ConfigMap follows (created if missing): it holds every root the Secret
// trusts, so nodes verify the signer's answers before and after the new
// root signs, and only the new root once the old one is retired; a root
// never signs before the ConfigMap held it. Keys of the Secret that are not
// CA material stay; kubectl's copy of the old key goes.
func TestRotateTheSignersSecret(t *testing.T) {
	cfg := kubetest.Start(t)
	kube := kubernetes.NewForConfigOrDie(cfg)
	ctx := t.Context()
	certPEM, keyPEM, err := identity.NewRootMaterial("cluster.local", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	_, err = kube.CoreV1().Secrets("kube-system").Create(ctx, &corev1.Secret{
		// As `kubectl apply` leaves it: a copy of the key in an annotation.
		ObjectMeta: metav1.ObjectMeta{Name: "mtlsbridge-ca", Annotations: map[string]string{
			"kubectl.kubernetes.io/last-applied-configuration": string(keyPEM)}},
		Data: map[string][]byte{identity.CACertFile: certPEM, identity.CAKeyFile: keyPEM, "note": []byte("kept")},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	first := certificates(t, certPEM)[0]
	kubeconfig := kubetest.WriteKubeconfig(t, cfg)
	run := func(step, want string) error {
		t.Helper()
		return runCA(t, want, step, "--secret=kube-system/mtlsbridge-ca", "--kubeconfig="+kubeconfig)
	}
	// state reads the Secret's signing root, its next root if any, and the
	// ConfigMap's roots.
	state := func() (signing, next *x509.Certificate, roots []*x509.Certificate) {
		t.Helper()
		s, err := kube.CoreV1().Secrets("kube-system").Get(ctx, "mtlsbridge-ca", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if string(s.Data["note"]) != "kept" {
			t.Errorf("the Secret's other key: %q", s.Data["note"])
		}
		// The first step rewrote the Secret without it, and nothing brings
		// it back.
		if _, ok := s.Annotations["kubectl.kubernetes.io/last-applied-configuration"]; ok {
			t.Error("the kubectl annotation, a copy of the first key, stayed")
		}
		if nextPEM, ok := s.Data[identity.NextCACertFile]; ok {
			next = certificates(t, nextPEM)[0]
		}
		cm, err := kube.CoreV1().ConfigMaps("kube-system").Get(ctx, "mtlsbridge-ca-roots", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return certificates(t, s.Data[identity.CACertFile])[0], next, certificates(t, []byte(cm.Data[identity.RootsKey]))
	}
	// same compares roots in the bundle's order: the one that signs (or is
	// about to) first.
	same := func(got []*x509.Certificate, want ...*x509.Certificate) bool {
		return slices.EqualFunc(got, want, (*x509.Certificate).Equal)
	}

	// 1. A new root is trusted; the first still signs. The ConfigMap did
	// not exist: it is created.
	must(t, run("rotate", "trusted"))
	signing, next, roots := state()
	if !signing.Equal(first) || next == nil || !same(roots, first, next) {
		t.Fatalf("after the first step: signing %v, next %v, roots %v", signing.Subject, next, roots)
	}
	second := next
	// The ConfigMap is lost (or edited): the new root does not sign until
	// the ConfigMap has had it long enough to reach the nodes.
	must(t, kube.CoreV1().ConfigMaps("kube-system").Delete(ctx, "mtlsbridge-ca-roots", metav1.DeleteOptions{}))
	if err := run("rotate", "run the step again"); !errors.Is(err, identity.ErrRootsNotPublished) {
		t.Fatalf("the second step without the roots published: %v, want ErrRootsNotPublished", err)
	}
	if signing, next, roots = state(); !signing.Equal(first) || !next.Equal(second) || !same(roots, second, first) {
		t.Fatalf("after the refused second step: signing %v, next %v, %d roots", signing.Subject, next, len(roots))
	}
	// 2. The new root signs; both stay trusted.
	must(t, run("rotate", "signs"))
	if signing, next, roots = state(); !signing.Equal(second) || next != nil || !same(roots, second, first) {
		t.Fatalf("after the second step: signing %v, next %v, %d roots", signing.Subject, next, len(roots))
	}
	// 3. Retired: the new root alone.
	must(t, run("retire", "retired"))
	if signing, _, roots = state(); !signing.Equal(second) || !same(roots, second) {
		t.Fatalf("after retire: signing %v, %d roots", signing.Subject, len(roots))
	}
	must(t, run("retire", "Nothing to retire"))
}

func certificates(t *testing.T, pemData []byte) []*x509.Certificate {
	t.Helper()
	var out []*x509.Certificate
	for block, rest := pem.Decode(pemData); block != nil; block, rest = pem.Decode(rest) {
		c, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, c)
	}
	if len(out) == 0 {
		t.Fatalf("no certificate in %q", pemData)
	}
	return out
}

// runCA runs `mtlsbridge ca ARGS...`; want is in its output, or in its
// error when it fails.
func runCA(t *testing.T, want string, args ...string) error {
	t.Helper()
	cmd := rootCmd()
	var out bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&out)
	cmd.SetArgs(append([]string{"ca"}, args...))
	err := cmd.Execute()
	if !strings.Contains(out.String()+fmt.Sprint(err), want) {
		t.Fatalf("ca %v: %v, %q (want %q)", args, err, out.String(), want)
	}
	return err
}

// ca init --secret creates the signer's CA Secret with a new root of the
// trust domain, and the nodes' roots ConfigMap with it; run again, it
// keeps the Secret and brings the ConfigMap back in step.
func TestInitTheSignersSecret(t *testing.T) {
	cfg := kubetest.Start(t)
	kube := kubernetes.NewForConfigOrDie(cfg)
	ctx := t.Context()
	args := []string{"init", "--secret=kube-system/mtlsbridge-ca", "--trust-domain=example.org", "--kubeconfig=" + kubetest.WriteKubeconfig(t, cfg)}
	// root reads the Secret's root and checks that the ConfigMap holds it
	// alone.
	root := func() *x509.Certificate {
		t.Helper()
		s, err := kube.CoreV1().Secrets("kube-system").Get(ctx, "mtlsbridge-ca", metav1.GetOptions{})
		must(t, err)
		m, err := identity.ParseMaterial(s.Data[identity.CACertFile], s.Data[identity.CAKeyFile], nil)
		must(t, err)
		cm, err := kube.CoreV1().ConfigMaps("kube-system").Get(ctx, "mtlsbridge-ca-roots", metav1.GetOptions{})
		must(t, err)
		if roots := certificates(t, []byte(cm.Data[identity.RootsKey])); len(roots) != 1 || !roots[0].Equal(m.Root) {
			t.Errorf("the roots ConfigMap holds %d roots, not the Secret's", len(roots))
		}
		return m.Root
	}

	must(t, runCA(t, "Created Secret kube-system/mtlsbridge-ca", args...))
	first := root()
	if len(first.URIs) != 1 || first.URIs[0].String() != "spiffe://example.org" {
		t.Errorf("the new root names %v, want spiffe://example.org", first.URIs)
	}
	must(t, kube.CoreV1().ConfigMaps("kube-system").Delete(ctx, "mtlsbridge-ca-roots", metav1.DeleteOptions{}))
	must(t, runCA(t, "exists and is kept", args...))
	if !root().Equal(first) {
		t.Error("a second init replaced the root")
	}
}
