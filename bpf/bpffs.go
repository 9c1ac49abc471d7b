// SPDX-License-Identifier: Apache-2.0

package bpf

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"

	"golang.org/x/sys/unix"
)

// DefaultBPFFS is where the bpf filesystem is mounted on a node.
const DefaultBPFFS = "/sys/fs/bpf"

// PrepareRoot makes root a folder for the agent's pins: on a bpf
// filesystem, owned by root, writable by root only. Its parent must be on a
// bpf filesystem already, except DefaultBPFFS, which is mounted when it is
// not (as cilium-agent does). An existing root is reused as it is, provided
// only root can write to it.
//
// Possible errors: ErrNotBPFFS, ErrUnsafePin, permission errors when not
// root.
func PrepareRoot(root string) error {
	parent := filepath.Dir(root)
	onBPFFS, err := isBPFFS(parent)
	if err != nil {
		return err
	}
	if !onBPFFS {
		if parent != DefaultBPFFS {
			return fmt.Errorf("%s: %w", parent, ErrNotBPFFS)
		}
		if err := unix.Mount("bpffs", parent, "bpf", 0, "mode=0700"); err != nil {
			return fmt.Errorf("mount bpffs on %s: %w", parent, err)
		}
	}
	if err := os.Mkdir(root, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return err
	}
	if ok, err := isBPFFS(root); err != nil || !ok {
		return errors.Join(err, fmt.Errorf("%s: %w", root, ErrNotBPFFS))
	}
	return checkOwner(root)
}

// PinDir returns a folder under root for pins of one kind, created if
// missing with the same guarantees as root.
func PinDir(root, name string) (string, error) {
	dir := filepath.Join(root, name)
	if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return "", err
	}
	return dir, checkOwner(dir)
}

func isBPFFS(path string) (bool, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return false, fmt.Errorf("statfs %s: %w", path, err)
	}
	return uint32(st.Type) == uint32(unix.BPF_FS_MAGIC), nil
}

// checkOwner refuses a path that someone other than root could change.
func checkOwner(path string) error {
	info, err := os.Lstat(path)
	if err != nil {
		return err
	}
	st, ok := info.Sys().(*syscall.Stat_t)
	if !ok || st.Uid != 0 || info.Mode().Perm()&0o022 != 0 || info.Mode()&os.ModeSymlink != 0 {
		return fmt.Errorf("%s (mode %s): %w", path, info.Mode(), ErrUnsafePin)
	}
	return nil
}

// checkPinOwner is checkOwner for a pin that may not exist yet.
func checkPinOwner(path string) error {
	if _, err := os.Lstat(path); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	return checkOwner(path)
}
