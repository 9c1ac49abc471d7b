// SPDX-License-Identifier: Apache-2.0

package deploy_test

import (
	"encoding/json"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// execEnv carries an execSpec to the test binary run as a helper: TestMain
// then turns the process into the agent, with only the given capabilities
// and in the given network namespace, the way a container runtime starts
// the sidecar (root, capabilities dropped but those added).
const execEnv = "MTLSBRIDGE_DEPLOY_TEST_EXEC"

type execSpec struct {
	// Netns is a network namespace to enter first (the test's node).
	Netns string
	// Caps are the capabilities to keep, by Kubernetes name (NET_ADMIN).
	Caps []string
	// User, when set, is whom the command runs as (a container's
	// runAsUser, runAsGroup and fsGroup), after the capabilities go.
	User *execUser
	Argv []string
}

type execUser struct {
	UID, GID int
	Groups   []int
}

func TestMain(m *testing.M) {
	if spec := os.Getenv(execEnv); spec != "" {
		err := execWithCaps(spec)
		fmt.Fprintln(os.Stderr, "exec helper:", err)
		os.Exit(127)
	}
	os.Exit(m.Run())
}

// capNumber maps the capabilities a container's securityContext may name
// here, by their Kubernetes names, to the kernel's numbers.
func capNumber(name string) (int, bool) {
	n, ok := map[string]int{
		"CHOWN": unix.CAP_CHOWN, "DAC_OVERRIDE": unix.CAP_DAC_OVERRIDE, "FOWNER": unix.CAP_FOWNER,
		"KILL": unix.CAP_KILL, "SETUID": unix.CAP_SETUID, "SETGID": unix.CAP_SETGID,
		"NET_BIND_SERVICE": unix.CAP_NET_BIND_SERVICE, "NET_ADMIN": unix.CAP_NET_ADMIN, "NET_RAW": unix.CAP_NET_RAW,
		"IPC_LOCK": unix.CAP_IPC_LOCK, "SYS_MODULE": unix.CAP_SYS_MODULE, "SYS_PTRACE": unix.CAP_SYS_PTRACE,
		"SYS_ADMIN": unix.CAP_SYS_ADMIN, "SYS_RESOURCE": unix.CAP_SYS_RESOURCE, "PERFMON": unix.CAP_PERFMON,
		"BPF": unix.CAP_BPF, "CHECKPOINT_RESTORE": unix.CAP_CHECKPOINT_RESTORE,
	}[name]
	return n, ok
}

// capMask is the set as /proc/PID/status prints it (CapEff).
func capMask(t *testing.T, caps []string) uint64 {
	t.Helper()
	var m uint64
	for _, c := range caps {
		n, ok := capNumber(c)
		if !ok {
			t.Fatalf("capability %s: unknown to the test", c)
		}
		m |= 1 << n
	}
	return m
}

// execWithCaps enters the namespace, drops every capability but spec.Caps
// from the bounding and inheritable sets, becomes spec.User if given, and
// executes the agent. Root's
// capabilities after execve are then exactly the bounding set (no file
// capabilities, no ambient ones). Everything happens on one locked thread:
// namespaces and capability sets are per thread, and execve runs on it.
func execWithCaps(raw string) error {
	runtime.LockOSThread()
	var spec execSpec
	if err := json.Unmarshal([]byte(raw), &spec); err != nil {
		return err
	}
	if spec.Netns != "" {
		fd, err := unix.Open(spec.Netns, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		if err := unix.Setns(fd, unix.CLONE_NEWNET); err != nil {
			return fmt.Errorf("setns %s: %w", spec.Netns, err)
		}
		unix.Close(fd)
	}
	keep := map[int]bool{}
	for _, c := range spec.Caps {
		n, ok := capNumber(c)
		if !ok {
			return fmt.Errorf("unknown capability %s", c)
		}
		keep[n] = true
	}
	lastRaw, err := os.ReadFile("/proc/sys/kernel/cap_last_cap")
	if err != nil {
		return err
	}
	last, err := strconv.Atoi(strings.TrimSpace(string(lastRaw)))
	if err != nil {
		return err
	}
	for c := 0; c <= last; c++ {
		if !keep[c] {
			if err := unix.Prctl(unix.PR_CAPBSET_DROP, uintptr(c), 0, 0, 0); err != nil {
				return fmt.Errorf("drop capability %d: %w", c, err)
			}
		}
	}
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return err
	}
	data[0].Inheritable, data[1].Inheritable = 0, 0
	if err := unix.Capset(&hdr, &data[0]); err != nil {
		return err
	}
	if u := spec.User; u != nil {
		// Groups are set for this thread only (the ids for every thread):
		// execve, next, runs on it.
		if err := unix.Setgroups(u.Groups); err != nil {
			return fmt.Errorf("setgroups %v: %w", u.Groups, err)
		}
		if err := unix.Setresgid(u.GID, u.GID, u.GID); err != nil {
			return fmt.Errorf("setresgid %d: %w", u.GID, err)
		}
		if err := unix.Setresuid(u.UID, u.UID, u.UID); err != nil {
			return fmt.Errorf("setresuid %d: %w", u.UID, err)
		}
	}
	env := make([]string, 0, len(os.Environ()))
	for _, e := range os.Environ() {
		if !strings.HasPrefix(e, execEnv+"=") {
			env = append(env, e)
		}
	}
	return unix.Exec(spec.Argv[0], spec.Argv, env)
}

// effectiveCaps reads a process's effective capability set.
func effectiveCaps(pid int) (uint64, error) {
	v, err := procStatus(pid, "CapEff")
	if err != nil {
		return 0, err
	}
	return strconv.ParseUint(v, 16, 64)
}

// effectiveUID reads a process's effective user id.
func effectiveUID(pid int) (int, error) {
	v, err := procStatus(pid, "Uid") // real, effective, saved, file system
	if err != nil {
		return 0, err
	}
	if ids := strings.Fields(v); len(ids) > 1 {
		return strconv.Atoi(ids[1])
	}
	return 0, fmt.Errorf("/proc/%d/status: Uid %q", pid, v)
}

// procStatus reads a field of /proc/PID/status.
func procStatus(pid int, field string) (string, error) {
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return "", err
	}
	for _, line := range strings.Split(string(status), "\n") {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			return strings.TrimSpace(v), nil
		}
	}
	return "", fmt.Errorf("no %s in /proc/%d/status", field, pid)
}
