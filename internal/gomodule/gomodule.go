// SPDX-License-Identifier: Apache-2.0

// Package gomodule finds this module's folder and builds its commands, for
// tests that run the real binaries.
package gomodule

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// goBinary is the go command of the toolchain running the test.
func goBinary() string { return filepath.Join(runtime.GOROOT(), "bin", "go") }

// Root is the folder of this module's go.mod, as the go command finds it
// from the test's working folder (its package).
func Root() (string, error) {
	out, err := exec.Command(goBinary(), "env", "GOMOD").Output()
	if err != nil {
		return "", fmt.Errorf("go env GOMOD: %w", err)
	}
	gomod := strings.TrimSpace(string(out))
	if gomod == "" || gomod == os.DevNull {
		return "", errors.New("go env GOMOD: not inside a module")
	}
	return filepath.Dir(gomod), nil
}

// Build builds each of the module's commands (./cmd/NAME) into dir.
func Build(t testing.TB, dir string, commands ...string) {
	t.Helper()
	root, err := Root()
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range commands {
		cmd := exec.Command(goBinary(), "build", "-o", filepath.Join(dir, name), "./cmd/"+name)
		cmd.Dir = root
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("go build ./cmd/%s: %v\n%s", name, err, out)
		}
	}
}
