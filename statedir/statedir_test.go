// SPDX-License-Identifier: Apache-2.0

package statedir

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mtlsbridge/mtlsbridge/internal/syncbuf"
)

func TestPrepare(t *testing.T) {
	base := t.TempDir()

	fresh := filepath.Join(base, "a", "state")
	if err := Prepare(fresh); err != nil {
		t.Fatal(err)
	}
	expectMode(t, fresh, os.ModeDir|0o700)

	wide := filepath.Join(base, "wide")
	must(t, os.Mkdir(wide, 0o777))
	must(t, os.Chmod(wide, 0o777))
	must(t, Prepare(wide))
	expectMode(t, wide, os.ModeDir|0o700)

	link := filepath.Join(base, "link")
	must(t, os.Symlink(fresh, link))
	if err := Prepare(link); !errors.Is(err, ErrNotPrivate) {
		t.Errorf("Prepare(symlink) = %v, want ErrNotPrivate", err)
	}

	file := filepath.Join(base, "file")
	must(t, os.WriteFile(file, nil, 0o600))
	if err := Prepare(file); !errors.Is(err, ErrNotPrivate) {
		t.Errorf("Prepare(file) = %v, want ErrNotPrivate", err)
	}

	if os.Geteuid() == 0 {
		foreign := filepath.Join(base, "foreign")
		must(t, os.Mkdir(foreign, 0o700))
		must(t, os.Chown(foreign, 65534, 65534))
		if err := Prepare(foreign); !errors.Is(err, ErrNotPrivate) || !strings.Contains(err.Error(), "uid 65534") {
			t.Errorf("Prepare(folder of nobody) = %v, want ErrNotPrivate naming the owner", err)
		}
	}
}

// A socket is 0600 whatever the umask, replaces a stale one, and goes
// with its listener.
func TestListenUnix(t *testing.T) {
	dir := shortDir(t)
	sock := filepath.Join(dir, "api.sock")
	old := syscall.Umask(0)
	defer syscall.Umask(old)

	stale, err := net.Listen("unix", sock)
	must(t, err)
	stale.(*net.UnixListener).SetUnlinkOnClose(false)
	stale.Close()

	l, err := ListenUnix(sock)
	must(t, err)
	expectMode(t, sock, os.ModeSocket|0o600)
	go func() {
		if c, err := l.Accept(); err == nil {
			c.Close()
		}
	}()
	c, err := net.Dial("unix", sock)
	must(t, err)
	c.Close()
	entries, _ := os.ReadDir(dir)
	if len(entries) != 1 {
		t.Errorf("the state folder holds %d entries, want only the socket (no temporary folder left)", len(entries))
	}
	must(t, CloseUnix(l, sock))
	if _, err := os.Lstat(sock); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("socket left after CloseUnix: %v", err)
	}
}

// A second agent waits for the first, says whom it waits for, and takes
// over once the first is gone.
func TestLockStateDir(t *testing.T) {
	dir := t.TempDir()
	first, err := LockStateDir(context.Background(), dir, slog.New(slog.DiscardHandler))
	must(t, err)

	var logs syncbuf.Buffer
	log := slog.New(slog.NewTextHandler(&logs, nil))
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	_, err = LockStateDir(ctx, dir, log)
	holder := fmt.Sprintf("mtlsbridge agent pid %d", os.Getpid())
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), holder) {
		t.Fatalf("second lock while the first holds it: %v, want a timeout naming %q", err, holder)
	}
	if !strings.Contains(logs.String(), "Waiting for state folder") || !strings.Contains(logs.String(), holder) {
		t.Errorf("no log line naming the holder:\n%s", logs.String())
	}

	got := make(chan error, 1)
	go func() {
		l, err := LockStateDir(context.Background(), dir, log)
		if err == nil {
			l.Release()
		}
		got <- err
	}()
	select {
	case err := <-got:
		t.Fatalf("second lock taken while the first holds it: %v", err)
	case <-time.After(3 * lockRetry):
	}
	must(t, first.Release())
	select {
	case err := <-got:
		must(t, err)
	case <-time.After(5 * time.Second):
		t.Fatal("second lock not taken after the first was released")
	}
	if !strings.Contains(logs.String(), "Took over state folder") {
		t.Errorf("no log line of the take-over:\n%s", logs.String())
	}
}

// A folder where no file can be written (bpffs) is locked on itself.
func TestLockFolder(t *testing.T) {
	dir := t.TempDir()
	first, err := LockFolder(context.Background(), dir, "BPF root", slog.New(slog.DiscardHandler))
	must(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	_, err = LockFolder(ctx, dir, "BPF root", slog.New(slog.DiscardHandler))
	if want := fmt.Sprintf("pid %d", os.Getpid()); !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), want) {
		t.Fatalf("second lock: %v, want a timeout naming %q", err, want)
	}
	must(t, first.Release())
	second, err := LockFolder(context.Background(), dir, "BPF root", slog.New(slog.DiscardHandler))
	must(t, err)
	second.Release()
}

func expectMode(t *testing.T, path string, want os.FileMode) {
	t.Helper()
	info, err := os.Lstat(path)
	must(t, err)
	if got := info.Mode() & (os.ModeType | os.ModePerm); got != want {
		t.Errorf("%s: mode %s, want %s", path, got, want)
	}
}

// shortDir is a temporary folder with a short path: UNIX socket paths are
// limited to 108 bytes.
func shortDir(t *testing.T) string {
	dir, err := os.MkdirTemp("", "sd-")
	must(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
