// SPDX-License-Identifier: Apache-2.0

package main

import (
	"os"
	"strings"
	"syscall"
)

// The Go runtime's monitor thread (sysmon) sleeps deeply while every
// processor is idle, and the next system call wakes it. A proxy on one
// processor that relays requests goes idle between them, so each request
// paid a futex wake of sysmon, then sysmon's 20 µs ticks took the
// processor from writes a little longer than that and handed it to another
// thread. On the testbed that was 11,000 sysmon wake-ups a second per
// proxy and a tenth of its CPU time; without the deep sleep, about 100,
// and a fifth less CPU per request (proxy/README.md, Performance).
//
// GODEBUG's schedtrace is the runtime's only switch for it: while it is
// set, sysmon never sleeps deeply. Its trace prints a line each schedtrace
// milliseconds; at the largest value, once every 24.8 days (and at start
// on a system up for longer). A fatal panic also prints the scheduler's
// state, a line per thread and goroutine, before the panic's message.
const (
	godebugEnv  = "GODEBUG"
	sysmonAwake = "schedtrace=2147483647"
)

// keepSysmonAwake executes the proxy again with sysmonAwake added to
// GODEBUG, unless GODEBUG sets schedtrace already (that choice is the
// operator's: schedtrace=0 turns this off). It returns only if there was
// nothing to do or the exec failed; then the proxy runs as it is.
func keepSysmonAwake() error {
	env, again := withSysmonAwake(os.Environ())
	if !again {
		return nil
	}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	return syscall.Exec(exe, os.Args, env)
}

// withSysmonAwake is environ with sysmonAwake in GODEBUG, and whether that
// changed anything.
func withSysmonAwake(environ []string) ([]string, bool) {
	env := make([]string, 0, len(environ)+1)
	godebug, found := "", false
	for _, kv := range environ {
		if v, ok := strings.CutPrefix(kv, godebugEnv+"="); ok {
			if !found { // the first one counts, as in the runtime
				godebug, found = v, true
			}
			continue
		}
		env = append(env, kv)
	}
	for setting := range strings.SplitSeq(godebug, ",") {
		if strings.HasPrefix(setting, "schedtrace=") {
			return environ, false
		}
	}
	if godebug != "" {
		godebug += ","
	}
	return append(env, godebugEnv+"="+godebug+sysmonAwake), true
}
