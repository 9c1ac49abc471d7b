// SPDX-License-Identifier: Apache-2.0

package kubetest

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/yaml"

	"github.com/mtlsbridge/mtlsbridge/internal/gomodule"
)

const (
	// CiliumVersion is the Cilium release whose CRDs and Helm chart the
	// tests use; hack/cilium.sh downloads its Go module.
	CiliumVersion = "v1.20.0"

	// CiliumEnv names the environment variable holding the folder of
	// Cilium's Go module, as hack/cilium.sh prints it (make test sets it).
	CiliumEnv = "MTLSBRIDGE_CILIUM"
)

// CiliumDir returns the folder of Cilium's Go module (CiliumVersion):
// $MTLSBRIDGE_CILIUM, or else the folder hack/cilium.sh prints, downloading
// the module into the Go module cache on first use. The module is source
// only: nothing of it is compiled, and go.mod does not require it.
func CiliumDir(t testing.TB) string {
	t.Helper()
	dir := os.Getenv(CiliumEnv)
	if dir == "" {
		root, err := gomodule.Root()
		if err != nil {
			t.Fatalf("kubetest: %v", err)
		}
		cmd := exec.Command(filepath.Join(root, "hack", "cilium.sh"))
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("kubetest: hack/cilium.sh: %v\n%s", err, stderr.Bytes())
		}
		dir = strings.TrimSpace(string(out))
	}
	// A folder of another release would pass silently otherwise: the module
	// cache names its folders module@version.
	if !strings.HasSuffix(filepath.Clean(dir), "@"+CiliumVersion) {
		t.Fatalf("kubetest: %s=%s is not Cilium %s's module folder", CiliumEnv, dir, CiliumVersion)
	}
	if _, err := os.Stat(filepath.Join(dir, "install", "kubernetes", "cilium", "Chart.yaml")); err != nil {
		t.Fatalf("kubetest: %s does not hold Cilium's chart: %v", dir, err)
	}
	return dir
}

// CiliumChart returns the folder of Cilium's Helm chart.
func CiliumChart(t testing.TB) string {
	t.Helper()
	return filepath.Join(CiliumDir(t), "install", "kubernetes", "cilium")
}

// CiliumCRDs returns the folder of Cilium's cilium.io/v2
// CustomResourceDefinitions, the ones its operator installs.
func CiliumCRDs(t testing.TB) string {
	t.Helper()
	return filepath.Join(CiliumDir(t), "pkg", "k8s", "apis", "cilium.io", "client", "crds", "v2")
}

// ApplyCiliumCRDs applies Cilium's real cilium.io/v2 CRDs (CiliumCRDs) and
// waits until each is Established: objects a test creates are validated
// and pruned by the schemas a Cilium cluster has.
func ApplyCiliumCRDs(t testing.TB, cfg *rest.Config) {
	t.Helper()
	ApplyCRDs(t, cfg, CiliumCRDs(t))
}

// ApplyCiliumCRDsWithout applies Cilium's CRDs with every schema property
// named property removed, wherever it is nested: the schema of a Cilium
// version that has dropped the field (CiliumNetworkPolicy's
// authentication is planned to go). The API server then prunes the field
// from objects it stores.
func ApplyCiliumCRDsWithout(t testing.TB, cfg *rest.Config, property string) {
	t.Helper()
	src := CiliumCRDs(t)
	files, err := filepath.Glob(filepath.Join(src, "*.yaml"))
	if err != nil {
		t.Fatalf("kubetest: %v", err)
	}
	dir := t.TempDir()
	removed := 0
	for _, file := range files {
		objs, err := readCRDs(file)
		if err != nil {
			t.Fatalf("kubetest: %v", err)
		}
		var out []byte
		for _, obj := range objs {
			removed += removeProperty(obj.Object, property)
			data, err := yaml.Marshal(obj.Object)
			if err != nil {
				t.Fatalf("kubetest: %v", err)
			}
			out = append(append(out, "---\n"...), data...)
		}
		if err := os.WriteFile(filepath.Join(dir, filepath.Base(file)), out, 0o600); err != nil {
			t.Fatalf("kubetest: %v", err)
		}
	}
	if removed == 0 {
		t.Fatalf("kubetest: no schema of Cilium's CRDs has a property %q", property)
	}
	ApplyCRDs(t, cfg, dir)
}

// removeProperty deletes name from every "properties" map under v (and
// from the "required" lists beside them), and returns how many it deleted.
func removeProperty(v any, name string) int {
	n := 0
	switch v := v.(type) {
	case map[string]any:
		if props, ok := v["properties"].(map[string]any); ok {
			if _, ok := props[name]; ok {
				delete(props, name)
				n++
				if req, ok := v["required"].([]any); ok {
					v["required"] = slices.DeleteFunc(req, func(r any) bool { return r == name })
				}
			}
		}
		for _, child := range v {
			n += removeProperty(child, name)
		}
	case []any:
		for _, child := range v {
			n += removeProperty(child, name)
		}
	}
	return n
}

// The resources of Cilium's CRDs that mtlsbridge reads.
var (
	CNPResource  = schema.GroupVersionResource{Group: "cilium.io", Version: "v2", Resource: "ciliumnetworkpolicies"}
	CCNPResource = schema.GroupVersionResource{Group: "cilium.io", Version: "v2", Resource: "ciliumclusterwidenetworkpolicies"}
	CEPResource  = schema.GroupVersionResource{Group: "cilium.io", Version: "v2", Resource: "ciliumendpoints"}
)
