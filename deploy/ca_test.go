// SPDX-License-Identifier: Apache-2.0

package deploy_test

import (
	"crypto/x509"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"

	"github.com/mtlsbridge/mtlsbridge/identity"
)

// createCAObjects runs deploy/create-ca-secret.sh and returns the Secret
// and the roots ConfigMap it prints.
func createCAObjects(t *testing.T, trustDomain string) (*corev1.Secret, *corev1.ConfigMap) {
	t.Helper()
	out, err := exec.Command("./create-ca-secret.sh", trustDomain).Output()
	if err != nil {
		var stderr []byte
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = ee.Stderr
		}
		t.Fatalf("create-ca-secret.sh: %v\n%s", err, stderr)
	}
	objs, err := parseYAML(out)
	must(t, err)
	if len(objs) != 2 {
		t.Fatalf("create-ca-secret.sh printed %d objects, want a Secret and a ConfigMap", len(objs))
	}
	return typed[corev1.Secret](t, objs[0]), typed[corev1.ConfigMap](t, objs[1])
}

// writeSecretDir writes a Secret's keys as files, as the kubelet mounts a
// Secret volume (--ca-dir).
func writeSecretDir(t *testing.T, s *corev1.Secret) string {
	t.Helper()
	dir := t.TempDir()
	for k, v := range s.Data {
		must(t, os.WriteFile(filepath.Join(dir, k), v, 0o400))
	}
	return dir
}

// TestCreateCASecret: the script's Secret is CA material the agent loads,
// named for the trust domain, in the namespace and name the signer mounts;
// its ConfigMap holds the root alone, named as the values mount it.
func TestCreateCASecret(t *testing.T) {
	s, roots := createCAObjects(t, "example.org")
	signer := typed[appsv1.Deployment](t, find(t, readFile(t, "kubernetes/mtlsbridge-signer.yaml"), "Deployment", "mtlsbridge-signer"))
	if v := volumeNamed(signer.Spec.Template.Spec.Volumes, "ca"); s.Namespace != signer.Namespace || v == nil || v.Secret == nil || s.Name != v.Secret.SecretName {
		t.Errorf("Secret %s/%s, not the signer's Secret volume", s.Namespace, s.Name)
	}
	ds, _ := ciliumDaemonSet(t, renderCilium(t, l2Values))
	if v := volumeNamed(ds.Spec.Template.Spec.Volumes, "mtlsbridge-ca-roots"); roots.Namespace != ds.Namespace || v == nil || v.ConfigMap == nil || roots.Name != v.ConfigMap.Name {
		t.Errorf("ConfigMap %s/%s, not the sidecar's roots volume", roots.Namespace, roots.Name)
	}
	if roots.Data["roots.pem"] != string(s.Data[identity.CACertFile]) {
		t.Errorf("the ConfigMap's roots.pem is not the Secret's root:\n%s", roots.Data["roots.pem"])
	}
	m, err := identity.LoadDir(writeSecretDir(t, s), "example.org", false)
	if err != nil {
		t.Fatalf("the agent refuses the script's material: %v", err)
	}
	root := m.Root
	if len(root.URIs) != 1 || root.URIs[0].String() != "spiffe://example.org" || !root.IsCA ||
		root.KeyUsage&x509.KeyUsageCertSign == 0 || root.Subject.Organization[0] != "example.org" {
		t.Errorf("root: URIs %v, CA %v, key usage %v, subject %v", root.URIs, root.IsCA, root.KeyUsage, root.Subject)
	}
	if days := root.NotAfter.Sub(root.NotBefore).Hours() / 24; days < 3649 || days > 3651 {
		t.Errorf("root valid %.0f days, want 3650", days)
	}
	// A second run is a new root, never the same key.
	if again, _ := createCAObjects(t, "example.org"); string(again.Data[identity.CAKeyFile]) == string(s.Data[identity.CAKeyFile]) {
		t.Error("two runs made the same key")
	}
	if err := exec.Command("./create-ca-secret.sh", "Not A Domain").Run(); err == nil {
		t.Error("an invalid trust domain was accepted")
	}
}

func volumeNamed(volumes []corev1.Volume, name string) *corev1.Volume {
	for i := range volumes {
		if volumes[i].Name == name {
			return &volumes[i]
		}
	}
	return nil
}
