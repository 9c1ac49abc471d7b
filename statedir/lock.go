// SPDX-License-Identifier: Apache-2.0

package statedir

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// LockFile is the lock of a state folder, holding a line naming its holder.
const LockFile = "agent.lock"

// Lock is a held lock; Release gives it up (so does the process's exit).
type Lock struct{ f *os.File }

// Release gives the lock up.
func (l *Lock) Release() error { return l.f.Close() }

// lockRetry is how often a waiting agent tries again; waitLogEvery how
// often it says that it still waits.
const (
	lockRetry    = 200 * time.Millisecond
	waitLogEvery = 10 * time.Second
)

// LockStateDir takes the state folder for this agent, waiting while another
// agent holds it (a rolling update with surge, a second agent started by
// hand): two agents on one folder would take each other's sockets and
// leave the node's CNI plugin talking to neither. The folder must have
// been prepared (Prepare). The holder writes who it is into the lock file,
// so that a waiting agent can name it.
func LockStateDir(ctx context.Context, dir string, log *slog.Logger) (*Lock, error) {
	f, err := os.OpenFile(filepath.Join(dir, LockFile), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, err
	}
	holder := func() string {
		b := make([]byte, 512)
		n, _ := f.ReadAt(b, 0)
		desc := strings.TrimSpace(string(b[:n]))
		if pid := flockHolder(f); pid > 0 {
			desc = fmt.Sprintf("%s (pid %d here)", desc, pid)
		}
		return desc
	}
	if err := waitFlock(ctx, f, "state folder "+dir, holder, log); err != nil {
		f.Close()
		return nil, err
	}
	host, _ := os.Hostname()
	desc := fmt.Sprintf("mtlsbridge agent pid %d on %s", os.Getpid(), host)
	if pod := os.Getenv("POD_NAME"); pod != "" {
		desc += " (pod " + os.Getenv("POD_NAMESPACE") + "/" + pod + ")"
	}
	desc += " since " + time.Now().UTC().Format(time.RFC3339)
	if err := f.Truncate(0); err == nil {
		_, err = f.WriteAt([]byte(desc+"\n"), 0)
		if err != nil {
			log.Warn("Cannot name this agent in the state folder's lock", "error", err)
		}
	}
	return &Lock{f: f}, nil
}

// LockFolder takes a folder (the BPF root on bpffs, where no lock file can
// be written) for this agent, waiting while another process holds it.
func LockFolder(ctx context.Context, dir, what string, log *slog.Logger) (*Lock, error) {
	f, err := os.Open(dir)
	if err != nil {
		return nil, err
	}
	holder := func() string {
		if pid := flockHolder(f); pid > 0 {
			return fmt.Sprintf("pid %d", pid)
		}
		return "another process"
	}
	if err := waitFlock(ctx, f, what+" "+dir, holder, log); err != nil {
		f.Close()
		return nil, err
	}
	return &Lock{f: f}, nil
}

// waitFlock takes an exclusive flock on f, retrying until ctx ends, and
// logs whom it waits for: at once, then every waitLogEvery.
func waitFlock(ctx context.Context, f *os.File, what string, holder func() string, log *slog.Logger) error {
	var lastLog time.Time
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			if !lastLog.IsZero() {
				log.Info("Took over "+what+" from the previous holder", "waited", time.Since(lastLog).Round(time.Second))
			}
			return nil
		}
		if !errors.Is(err, unix.EWOULDBLOCK) {
			return fmt.Errorf("lock %s: %w", what, err)
		}
		if time.Since(lastLog) >= waitLogEvery {
			log.Warn("Waiting for "+what+": another agent holds it; this one starts when it stops", "holder", holder())
			lastLog = time.Now()
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for %s held by %s: %w", what, holder(), ctx.Err())
		case <-time.After(lockRetry):
		}
	}
}

// flockHolder finds the process holding a flock on f's file in
// /proc/locks (pid as this process's pid namespace sees it), or 0.
func flockHolder(f *os.File) int {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return 0
	}
	want := fmt.Sprintf("%02x:%02x:%d", unix.Major(st.Dev), unix.Minor(st.Dev), st.Ino)
	locks, err := os.Open("/proc/locks")
	if err != nil {
		return 0
	}
	defer locks.Close()
	sc := bufio.NewScanner(locks)
	for sc.Scan() {
		// "1: FLOCK  ADVISORY  WRITE 1234 00:1f:5678 0 EOF"
		fields := strings.Fields(sc.Text())
		if len(fields) >= 6 && fields[1] == "FLOCK" && fields[5] == want {
			pid, _ := strconv.Atoi(fields[4])
			return pid
		}
	}
	return 0
}
