//go:build !linux

package kubetest

import "os/exec"

// setDeathSignal does nothing where there is no parent-death signal: a test
// binary that dies without running its cleanups leaves its children running.
func setDeathSignal(*exec.Cmd) {}
