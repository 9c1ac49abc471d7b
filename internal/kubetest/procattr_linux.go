package kubetest

import (
	"os/exec"
	"syscall"
)

// setDeathSignal makes the kernel kill the child if the test binary dies
// without running its cleanups, for example when go test's -timeout fires.
func setDeathSignal(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
