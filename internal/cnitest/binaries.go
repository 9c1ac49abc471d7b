// SPDX-License-Identifier: Apache-2.0

package cnitest

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// PluginsEnv names the folder that holds the reference plugins, as
// hack/cni-plugins.sh prints it (make test sets it).
const PluginsEnv = "MTLSBRIDGE_CNI_PLUGINS"

// Reference plugins, from PluginsEnv, and ours, built from this module.
var (
	referencePlugins = []string{"ptp", "static"}
	ourCommands      = []string{"mtlsbridge", "mtlsbridge-cni", "mtlsbridge-proxy"}
)

// Plugins returns the folder of the reference plugins ptp and static: that
// of PluginsEnv, or else the one hack/cni-plugins.sh fills (and prints),
// building them on first use. It serves as CNI_PATH for a chain of reference
// plugins only.
func Plugins(t testing.TB) string {
	t.Helper()
	dir := os.Getenv(PluginsEnv)
	if dir == "" {
		root, err := moduleRoot()
		if err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command(filepath.Join(root, "hack", "cni-plugins.sh"))
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("hack/cni-plugins.sh: %v\n%s", err, stderr.Bytes())
		}
		dir = strings.TrimSpace(string(out))
	}
	for _, name := range referencePlugins {
		if _, err := exec.LookPath(filepath.Join(dir, name)); err != nil {
			t.Fatalf("%s: %v (run hack/cni-plugins.sh, or unset %s)", name, err, PluginsEnv)
		}
	}
	return dir
}

// Binaries returns a folder for CNI_PATH holding ptp and static (Plugins)
// and mtlsbridge, mtlsbridge-cni and mtlsbridge-proxy, built from this
// module's source (a few seconds with a warm build cache). The folder is
// the test's and goes with it; call Binaries once per test and hand the
// folder around.
func Binaries(t testing.TB) string {
	t.Helper()
	plugins := Plugins(t)
	root, err := moduleRoot()
	if err != nil {
		t.Fatal(err)
	}
	// A short path under the temporary folder rather than t.TempDir's,
	// which carries the test's name: it shows up in every CNI_PATH and
	// error message.
	dir, err := os.MkdirTemp("", "cnibin-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	for _, name := range referencePlugins {
		if err := os.Symlink(filepath.Join(plugins, name), filepath.Join(dir, name)); err != nil {
			t.Fatal(err)
		}
	}
	gobin := filepath.Join(runtime.GOROOT(), "bin", "go")
	for _, name := range ourCommands {
		cmd := exec.Command(gobin, "build", "-o", filepath.Join(dir, name), "./cmd/"+name)
		cmd.Dir = root
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("go build ./cmd/%s: %v\n%s", name, err, out)
		}
	}
	return dir
}

// moduleRoot is the folder of this module's go.mod, as the go command
// finds it from the test's working folder (its package).
func moduleRoot() (string, error) {
	out, err := exec.Command(filepath.Join(runtime.GOROOT(), "bin", "go"), "env", "GOMOD").Output()
	if err != nil {
		return "", fmt.Errorf("go env GOMOD: %w", err)
	}
	gomod := strings.TrimSpace(string(out))
	if gomod == "" || gomod == os.DevNull {
		return "", errors.New("go env GOMOD: not inside a module")
	}
	return filepath.Dir(gomod), nil
}
