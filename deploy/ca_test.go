// SPDX-License-Identifier: Apache-2.0

package deploy_test

import (
	"crypto/x509"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	corev1 "k8s.io/api/core/v1"

	"github.com/mtlsbridge/mtlsbridge/identity"
)

// createCASecret runs deploy/create-ca-secret.sh and returns the Secret it
// prints.
func createCASecret(t *testing.T, trustDomain string) *corev1.Secret {
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
	if len(objs) != 1 {
		t.Fatalf("create-ca-secret.sh printed %d objects, want one Secret", len(objs))
	}
	return typed[corev1.Secret](t, objs[0])
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
// named for the trust domain, in the namespace and name the values mount.
func TestCreateCASecret(t *testing.T) {
	s := createCASecret(t, "example.org")
	if s.Namespace != ciliumNS || s.Name != "mtlsbridge-ca" {
		t.Errorf("Secret %s/%s, want %s/mtlsbridge-ca (the values' Secret volume)", s.Namespace, s.Name, ciliumNS)
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
	if again := createCASecret(t, "example.org"); string(again.Data[identity.CAKeyFile]) == string(s.Data[identity.CAKeyFile]) {
		t.Error("two runs made the same key")
	}
	if err := exec.Command("./create-ca-secret.sh", "Not A Domain").Run(); err == nil {
		t.Error("an invalid trust domain was accepted")
	}
}
