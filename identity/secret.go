// SPDX-License-Identifier: Apache-2.0

package identity

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"strings"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// RootsKey is the key of the trust domain's roots in the nodes' roots
// ConfigMap (--ca-upstream-roots reads it as a file).
const RootsKey = "roots.pem"

// materialFiles are the files of a CA folder, and the keys of a CA Secret.
var materialFiles = []string{CACertFile, CAKeyFile, TrustedRootsFile, NextCACertFile, NextCAKeyFile}

// StepSecret runs a step of a root rotation (RotateDir, RetireDir) on the
// CA material of a Secret (NAMESPACE/NAME) and keeps the nodes' roots
// ConfigMap in step: it then holds the material's bundle, the roots the
// signer's answers are verified with. The ConfigMap is written first: a
// step never takes a root the signer signs with out of the bundle, so
// nodes that trust more for a while verify the same answers, and a run
// interrupted between the two writes is completed by running it again
// (the step is computed from the Secret, which has not changed).
// The Secret's update fails if it changed since it was read.
func StepSecret(ctx context.Context, kube kubernetes.Interface, secretName, rootsName string, step func(dir string) error) error {
	ns, name, ok := strings.Cut(secretName, "/")
	if !ok || ns == "" || name == "" {
		return fmt.Errorf("Secret %q: want NAMESPACE/NAME", secretName)
	}
	secrets := kube.CoreV1().Secrets(ns)
	secret, err := secrets.Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("Secret %s: %w", secretName, err)
	}
	dir, err := os.MkdirTemp("", "mtlsbridge-ca-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	for _, file := range materialFiles {
		if data, ok := secret.Data[file]; ok {
			if err := os.WriteFile(filepath.Join(dir, file), data, 0o600); err != nil {
				return err
			}
		}
	}
	if err := step(dir); err != nil {
		return err
	}
	data := maps.Clone(secret.Data)
	for _, file := range materialFiles {
		content, err := os.ReadFile(filepath.Join(dir, file))
		switch {
		case errors.Is(err, os.ErrNotExist):
			delete(data, file)
		case err != nil:
			return err
		default:
			data[file] = content
		}
	}
	m, err := ParseMaterial(data[CACertFile], data[CAKeyFile], data[TrustedRootsFile])
	if err != nil {
		return fmt.Errorf("Secret %s after the step: %w", secretName, err)
	}
	if err := writeRoots(ctx, kube, rootsName, string(m.BundlePEM())); err != nil {
		return err
	}
	if maps.EqualFunc(secret.Data, data, bytes.Equal) {
		return nil
	}
	secret.Data = data
	if _, err := secrets.Update(ctx, secret, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("Secret %s: %w (the roots ConfigMap %s has the new roots already: run the step again)", secretName, err, rootsName)
	}
	return nil
}

// writeRoots makes the ConfigMap (NAMESPACE/NAME) hold roots under
// RootsKey, creating it if it does not exist.
func writeRoots(ctx context.Context, kube kubernetes.Interface, name, roots string) error {
	ns, n, ok := strings.Cut(name, "/")
	if !ok || ns == "" || n == "" {
		return fmt.Errorf("roots ConfigMap %q: want NAMESPACE/NAME", name)
	}
	configMaps := kube.CoreV1().ConfigMaps(ns)
	cm, err := configMaps.Get(ctx, n, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		_, err = configMaps.Create(ctx, &corev1.ConfigMap{
			ObjectMeta: metav1.ObjectMeta{Name: n, Namespace: ns},
			Data:       map[string]string{RootsKey: roots},
		}, metav1.CreateOptions{})
	case err == nil && cm.Data[RootsKey] != roots:
		if cm.Data == nil {
			cm.Data = map[string]string{}
		}
		cm.Data[RootsKey] = roots
		_, err = configMaps.Update(ctx, cm, metav1.UpdateOptions{})
	}
	if err != nil {
		return fmt.Errorf("roots ConfigMap %s: %w", name, err)
	}
	return nil
}
