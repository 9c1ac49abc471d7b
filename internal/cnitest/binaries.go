// SPDX-License-Identifier: Apache-2.0

package cnitest

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/mtlsbridge/mtlsbridge/internal/gomodule"
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
		root, err := gomodule.Root()
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
	gomodule.Build(t, dir, ourCommands...)
	return dir
}
