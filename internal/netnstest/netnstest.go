// SPDX-License-Identifier: Apache-2.0

// Package netnstest builds throw-away network topologies for privileged
// tests: network namespaces as nodes, pods and an mTLS agent, joined by veth
// pairs, plus a per-test bpffs folder.
//
// Safety rules it enforces by construction: every address and route goes
// into a namespace the test created, never the root namespace; sockets are
// opened from a goroutine locked into the namespace (NS.Do), so nothing is
// ever dialled from the root namespace; everything created is removed by
// t.Cleanup.
package netnstest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/mtlsbridge/mtlsbridge/internal/nsthread"
)

// RequireEnv names the environment variable that, set to 1, turns a skipped
// privileged test into a failure (CI sets it).
const RequireEnv = "MTLSBRIDGE_REQUIRE_PRIVILEGED"

// RequirePrivileged skips the test unless it runs as root, or fails it
// when RequireEnv is 1.
func RequirePrivileged(t testing.TB) {
	t.Helper()
	if os.Geteuid() == 0 {
		return
	}
	if os.Getenv(RequireEnv) == "1" {
		t.Fatalf("this test needs root (network namespaces, BPF) and %s=1 forbids skipping it", RequireEnv)
	}
	t.Skipf("skipped: needs root for network namespaces and BPF (set %s=1 to make this a failure)", RequireEnv)
}

// NS is a named network namespace created for one test.
type NS struct {
	Name   string
	Handle netns.NsHandle
}

// NewNS creates a network namespace named after prefix with a random
// suffix, with its loopback up; t.Cleanup deletes it, and with it every
// interface inside.
func NewNS(t testing.TB, prefix string) *NS {
	t.Helper()
	name := prefix + "-" + randomSuffix()
	var h netns.NsHandle
	err := onLockedThread(func() error {
		orig, err := netns.Get()
		if err != nil {
			return err
		}
		defer orig.Close()
		h, err = netns.NewNamed(name)
		if err != nil {
			return err
		}
		return netns.Set(orig)
	})
	if err != nil {
		t.Fatalf("create netns %s: %v", name, err)
	}
	ns := &NS{Name: name, Handle: h}
	t.Cleanup(func() {
		h.Close()
		if err := netns.DeleteNamed(name); err != nil {
			t.Errorf("delete netns %s: %v", name, err)
		}
	})
	must(t, ns.Do(func() error {
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			return err
		}
		return netlink.LinkSetUp(lo)
	}))
	return ns
}

// Pin pins the namespace at path as a container runtime pins a pod's (a
// bind mount of its /var/run/netns file); t.Cleanup unmounts it.
func (ns *NS) Pin(t testing.TB, path string) {
	t.Helper()
	must(t, os.WriteFile(path, nil, 0o600))
	must(t, wrap(unix.Mount(filepath.Join("/var/run/netns", ns.Name), path, "", unix.MS_BIND, ""), "pin netns %s at %s", ns.Name, path))
	t.Cleanup(func() {
		if err := unix.Unmount(path, unix.MNT_DETACH); err != nil {
			t.Errorf("unpin netns %s: %v", path, err)
		}
		os.Remove(path)
	})
}

// Do runs fn on an OS thread switched into the namespace. Sockets fn opens
// belong to the namespace and may be used from any goroutine afterwards.
func (ns *NS) Do(fn func() error) error { return nsthread.Do(ns.Handle, fn) }

// HTTPClient returns a client whose connections are opened from inside the
// namespace (its loopback, addresses only it reaches).
func (ns *NS) HTTPClient(timeout time.Duration) *http.Client {
	return &http.Client{Timeout: timeout, Transport: &http.Transport{
		DialContext: func(ctx context.Context, network, addr string) (c net.Conn, err error) {
			err = ns.Do(func() error {
				var d net.Dialer
				c, err = d.DialContext(ctx, network, addr)
				return err
			})
			return c, err
		},
	}}
}

// Sysctl writes a value under /proc/sys/net of the namespace, e.g.
// Sysctl("ipv4/ip_forward", "1").
func (ns *NS) Sysctl(t testing.TB, name, value string) {
	t.Helper()
	must(t, ns.Do(func() error {
		return os.WriteFile(filepath.Join("/proc/sys/net", name), []byte(value), 0o644)
	}))
}

// Netlink returns a netlink handle that works in the namespace.
func (ns *NS) Netlink(t testing.TB) *netlink.Handle {
	t.Helper()
	h, err := netlink.NewHandleAt(ns.Handle)
	must(t, err)
	t.Cleanup(h.Close)
	return h
}

// onLockedThread runs fn on a dedicated, locked OS thread. If fn fails to
// restore the thread's namespace, the thread stays locked and the runtime
// discards it with the goroutine.
func onLockedThread(fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		err := fn()
		if err == nil {
			runtime.UnlockOSThread()
		}
		errc <- err
	}()
	return <-errc
}

// BPFRoot returns a fresh folder on bpffs for one test's pins, and removes
// it (with the pins, which releases maps and links nobody else holds) when
// the test ends. /sys/fs/bpf is mounted first if it is not bpffs yet, as an
// agent on a node would.
func BPFRoot(t testing.TB) string {
	t.Helper()
	const bpffs = "/sys/fs/bpf"
	var st unix.Statfs_t
	must(t, unix.Statfs(bpffs, &st))
	if uint32(st.Type) != uint32(unix.BPF_FS_MAGIC) {
		must(t, unix.Mount("bpffs", bpffs, "bpf", 0, "mode=0700"))
	}
	dir, err := os.MkdirTemp(bpffs, "mtlsbridge-test-")
	must(t, err)
	t.Cleanup(func() {
		if err := os.RemoveAll(dir); err != nil {
			t.Errorf("remove %s: %v", dir, err)
		}
	})
	return dir
}

func randomSuffix() string {
	b := make([]byte, 4)
	rand.Read(b)
	return hex.EncodeToString(b)
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// wrap adds context to an error, keeping nil as nil.
func wrap(err error, format string, args ...any) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf(format+": %w", append(args, err)...)
}
