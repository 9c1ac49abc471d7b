// SPDX-License-Identifier: Apache-2.0

package identity

import (
	"bytes"
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// namespacedName splits NAMESPACE/NAME, the name of an object of kind.
func namespacedName(kind, name string) (namespace, n string, err error) {
	namespace, n, ok := strings.Cut(name, "/")
	if !ok || namespace == "" || n == "" {
		return "", "", fmt.Errorf("%s %q: want NAMESPACE/NAME", kind, name)
	}
	return namespace, n, nil
}

// RootsKey is the key of the trust domain's roots in the nodes' roots
// ConfigMap (--ca-upstream-roots reads it as a file).
const RootsKey = "roots.pem"

// lastAppliedAnnotation is where `kubectl apply` keeps a copy of what it
// applied: for a CA Secret, a copy of its key.
const lastAppliedAnnotation = "kubectl.kubernetes.io/last-applied-configuration"

// ErrRootsNotPublished: a step would make a root sign that the nodes'
// roots ConfigMap did not hold; the ConfigMap holds it now, and the step
// is to be run again once the ConfigMap has reached every node.
var ErrRootsNotPublished = errors.New("the roots ConfigMap did not hold the root about to sign")

// InitSecret creates the signer's CA Secret (NAMESPACE/NAME) with a new
// root of trustDomain, and the nodes' roots ConfigMap with it. A Secret
// that exists is kept (created is false): the ConfigMap is then made to
// hold its roots, so that a run interrupted between the two writes is
// completed by running it again.
func InitSecret(ctx context.Context, kube kubernetes.Interface, secretName, rootsName, trustDomain string) (created bool, err error) {
	ns, name, err := namespacedName("Secret", secretName)
	if err != nil {
		return false, err
	}
	secrets := kube.CoreV1().Secrets(ns)
	secret, err := secrets.Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		certPEM, keyPEM, genErr := NewRootMaterial(trustDomain, rootValidity)
		if genErr != nil {
			return false, genErr
		}
		secret, err = secrets.Create(ctx, &corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: map[string]string{"app.kubernetes.io/name": "mtlsbridge"}},
			Type:       corev1.SecretTypeOpaque,
			Data:       map[string][]byte{CACertFile: certPEM, CAKeyFile: keyPEM},
		}, metav1.CreateOptions{})
		created = err == nil
	}
	if err != nil {
		return false, fmt.Errorf("Secret %s: %w", secretName, err)
	}
	m, err := loadMaterial(memoryFiles{"Secret " + secretName, secret.Data})
	if err != nil {
		return created, fmt.Errorf("Secret %s: %w", secretName, err)
	}
	_, err = writeRoots(ctx, kube, rootsName, m.BundlePEM())
	return created, err
}

// RotateSecret is RotateDir on the CA material of a Secret
// (NAMESPACE/NAME), with the nodes' roots ConfigMap (NAMESPACE/NAME) kept
// in step (see stepSecret).
func RotateSecret(ctx context.Context, kube kubernetes.Interface, secret, roots, trustDomain string) (RotationStep, error) {
	var step RotationStep
	err := stepSecret(ctx, kube, secret, roots, func(files materialFiles) (err error) {
		step, err = rotate(files, trustDomain)
		return err
	})
	return step, err
}

// RetireSecret is RetireDir on the CA material of a Secret, with the
// nodes' roots ConfigMap kept in step.
func RetireSecret(ctx context.Context, kube kubernetes.Interface, secret, roots string) error {
	return stepSecret(ctx, kube, secret, roots, retire)
}

// stepSecret runs a rotation step on a Secret's material, in memory, and
// writes the bundle it then trusts to the roots ConfigMap before the
// Secret: the nodes verify the signer's answers with the ConfigMap, so it
// must hold a root before that root signs. A step that makes a new root
// sign is refused (ErrRootsNotPublished) while the ConfigMap, as read,
// lacks that root (it was missing, edited, or written by a run that
// lost a race): the ConfigMap is written, and the Secret left for a run
// once it has reached the nodes. A Secret that changed since it was read
// is not overwritten.
func stepSecret(ctx context.Context, kube kubernetes.Interface, secretName, rootsName string, step func(materialFiles) error) error {
	ns, name, err := namespacedName("Secret", secretName)
	if err != nil {
		return err
	}
	secrets := kube.CoreV1().Secrets(ns)
	secret, err := secrets.Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("Secret %s: %w", secretName, err)
	}
	before, err := loadMaterial(memoryFiles{"Secret " + secretName, secret.Data})
	if err != nil {
		return fmt.Errorf("Secret %s: %w", secretName, err)
	}
	files := memoryFiles{"Secret " + secretName, maps.Clone(secret.Data)}
	if err := step(files); err != nil {
		return err
	}
	after, err := loadMaterial(files)
	if err != nil {
		return fmt.Errorf("Secret %s after the step: %w", secretName, err)
	}
	published, err := writeRoots(ctx, kube, rootsName, after.BundlePEM())
	if err != nil {
		return err
	}
	if !after.Root.Equal(before.Root) && !slices.ContainsFunc(published, after.Root.Equal) {
		return fmt.Errorf("%w (%s): it holds it now; once it has reached every node (the kubelet's sync, about a minute), run the step again",
			ErrRootsNotPublished, rootsName)
	}
	if maps.EqualFunc(secret.Data, files.files, bytes.Equal) {
		return nil
	}
	secret.Data = files.files
	delete(secret.Annotations, lastAppliedAnnotation)
	if _, err := secrets.Update(ctx, secret, metav1.UpdateOptions{}); err != nil {
		// An update that was applied although its answer was lost is done.
		if now, getErr := secrets.Get(ctx, name, metav1.GetOptions{}); getErr == nil && maps.EqualFunc(now.Data, files.files, bytes.Equal) {
			return nil
		}
		return fmt.Errorf("Secret %s not updated: %w (the roots ConfigMap %s trusts its new roots already, which is harmless; run the step again)",
			secretName, err, rootsName)
	}
	return nil
}

// writeRoots makes the ConfigMap (NAMESPACE/NAME) hold roots under
// RootsKey, creating it if it does not exist, and returns the roots it
// held before.
func writeRoots(ctx context.Context, kube kubernetes.Interface, name string, roots []byte) ([]*x509.Certificate, error) {
	ns, n, err := namespacedName("roots ConfigMap", name)
	if err != nil {
		return nil, err
	}
	configMaps := kube.CoreV1().ConfigMaps(ns)
	cm, err := configMaps.Get(ctx, n, metav1.GetOptions{})
	var held []*x509.Certificate
	switch {
	case apierrors.IsNotFound(err):
		_, err = configMaps.Create(ctx, &corev1.ConfigMap{
			ObjectMeta: metav1.ObjectMeta{Name: n, Namespace: ns},
			Data:       map[string]string{RootsKey: string(roots)},
		}, metav1.CreateOptions{})
	case err == nil:
		held, _ = parseCertificates([]byte(cm.Data[RootsKey]))
		if cm.Data[RootsKey] != string(roots) {
			if cm.Data == nil {
				cm.Data = map[string]string{}
			}
			cm.Data[RootsKey] = string(roots)
			_, err = configMaps.Update(ctx, cm, metav1.UpdateOptions{})
		}
	}
	if err != nil {
		return nil, fmt.Errorf("roots ConfigMap %s: %w", name, err)
	}
	return held, nil
}
