// SPDX-License-Identifier: Apache-2.0

// Package atomicfile writes files so that a reader, or a crash, sees the
// old content or the new, never half of either. It imports nothing but the
// standard library: the CNI plugin binary uses it too.
package atomicfile

import (
	"os"
	"path/filepath"
)

// Write writes data to path through a fresh temporary file in the same
// folder, with exactly mode (never the mode of a file left behind, nor one
// widened by the umask), synced and renamed into place. The temporary
// name is hidden and has no .conf/.conflist/.json/.pem suffix, so that a
// CNI runtime or a loader watching the folder ignores it.
func Write(path string, data []byte, mode os.FileMode) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), ".mtlsbridge-tmp-")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name()) // after a successful rename there is nothing left to remove
	if err := tmp.Chmod(mode); err != nil {
		tmp.Close()
		return err
	}
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}
