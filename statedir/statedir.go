// SPDX-License-Identifier: Apache-2.0

// Package statedir is the agent's state folder on the node (--state-dir):
// its sockets, the CNI reports, the CA of folder mode. Whoever can write
// there, or connect to its sockets, controls the node's mTLS, so the folder
// is private to the agent's user (0700, never a symlink, owned by it),
// sockets are created 0600 with no moment at which another user could
// connect, and one agent at a time owns it (see Lock).
package statedir

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"syscall"
)

// ErrNotPrivate: the state folder, or something at its path, is not a
// folder of the agent's user that it can make private.
var ErrNotPrivate = errors.New("not a private folder of the agent's user")

// Prepare creates the folder at path (and its parents) and makes it
// private: 0700, owned by the calling user. A folder that exists with a
// wider mode is narrowed. A symlink, or a folder of another user, is
// refused: an attacker who prepared it would see everything written
// there.
func Prepare(path string) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	if err := os.Mkdir(path, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
		return err
	}
	info, err := os.Lstat(path)
	if err != nil {
		return err
	}
	if !info.IsDir() {
		return fmt.Errorf("%s: %w: it is a %s", path, ErrNotPrivate, info.Mode().Type())
	}
	if st, ok := info.Sys().(*syscall.Stat_t); ok && int(st.Uid) != os.Geteuid() {
		return fmt.Errorf("%s: %w: owned by uid %d, the agent runs as uid %d", path, ErrNotPrivate, st.Uid, os.Geteuid())
	}
	if info.Mode().Perm() != 0o700 {
		if err := os.Chmod(path, 0o700); err != nil {
			return fmt.Errorf("%s: make private: %w", path, err)
		}
	}
	return nil
}

// ListenUnix listens on a UNIX socket at path, replacing a stale socket
// there. The socket is 0600 from the moment its name appears: it is bound
// in a fresh private folder beside path, made 0600 there, and renamed into
// place. (Binding at path and then changing its mode would leave a moment
// in which the umask decides who may connect.) Closing the listener
// removes the socket.
func ListenUnix(path string) (*net.UnixListener, error) { return listenUnix("unix", path) }

// ListenUnixPacket is ListenUnix for a SOCK_SEQPACKET socket (ZDS).
func ListenUnixPacket(path string) (*net.UnixListener, error) { return listenUnix("unixpacket", path) }

func listenUnix(network, path string) (*net.UnixListener, error) {
	tmpDir, err := os.MkdirTemp(filepath.Dir(path), ".sock-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmpDir)
	tmp := filepath.Join(tmpDir, filepath.Base(path))
	l, err := net.ListenUnix(network, &net.UnixAddr{Name: tmp, Net: network})
	if err != nil {
		return nil, err
	}
	// The listener would unlink its original name on Close, which no
	// longer exists; unlinkOnClose below removes the real one.
	l.SetUnlinkOnClose(false)
	if err := os.Chmod(tmp, 0o600); err != nil {
		l.Close()
		return nil, err
	}
	if err := os.Rename(tmp, path); err != nil {
		l.Close()
		return nil, err
	}
	return l, nil
}

// CloseUnix closes a listener of ListenUnix and removes its socket. Only
// the holder of the state folder's lock serves there, so the name is
// still its own.
func CloseUnix(l *net.UnixListener, path string) error {
	err := l.Close()
	if rmErr := os.Remove(path); rmErr != nil && !errors.Is(rmErr, os.ErrNotExist) {
		err = errors.Join(err, rmErr)
	}
	return err
}
