// SPDX-License-Identifier: Apache-2.0

package cni

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"github.com/mtlsbridge/mtlsbridge/internal/atomicfile"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// store keeps each cni-pods row in a file of the state folder. The ADD of
// a pod returns before the kubelet writes the pod's addresses to the API:
// an agent restarted in between must still know them, or it would remove
// the pod's redirection. The folder lives as long as the node's pinned BPF
// state (/var/run is cleared at boot, like bpffs), so a reboot forgets both.
type store struct{ dir string }

func newStore(dir string) *store { return &store{dir: filepath.Join(dir, "cni-pods")} }

// containerIDPattern is what the CNI specification allows in a container
// id; it also makes the id a safe file name.
var containerIDPattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.\-]{0,254}$`)

func validContainerID(id string) error {
	if !containerIDPattern.MatchString(id) {
		return fmt.Errorf("containerID %q: want 1 to 255 letters, digits, '_', '.' or '-', starting with a letter or digit", id)
	}
	return nil
}

func (s *store) path(id string) string { return filepath.Join(s.dir, id+".json") }

// save writes the row atomically: a crash leaves the old file or the new.
func (s *store) save(row *tables.CNIPod) error {
	b, err := json.Marshal(row)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(s.dir, 0o700); err != nil {
		return err
	}
	return atomicfile.Write(s.path(row.ContainerID), b, 0o600)
}

func (s *store) remove(id string) error {
	if err := os.Remove(s.path(id)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// load reads every row. A file that does not parse is reported and left
// for the operator; the others load.
func (s *store) load() ([]*tables.CNIPod, []error) {
	entries, err := os.ReadDir(s.dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, []error{err}
	}
	var rows []*tables.CNIPod
	var errs []error
	for _, e := range entries {
		id, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok || e.IsDir() {
			continue
		}
		b, err := os.ReadFile(filepath.Join(s.dir, e.Name()))
		if err != nil {
			errs = append(errs, err)
			continue
		}
		var row tables.CNIPod
		switch err := json.Unmarshal(b, &row); {
		case err != nil:
			errs = append(errs, fmt.Errorf("%s: %w", e.Name(), err))
		case row.ContainerID != id || row.Pod == "":
			errs = append(errs, fmt.Errorf("%s: holds container %q of pod %q", e.Name(), row.ContainerID, row.Pod))
		default:
			if row.IPs, err = podAddrs(row.IPs); err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", e.Name(), err))
				continue
			}
			rows = append(rows, &row)
		}
	}
	return rows, errs
}

// firstStartFile holds when an agent first started since the node booted.
const firstStartFile = "first-start"

// FirstStart is when an agent first started since the node booted, with
// the boot's id and its CLOCK_BOOTTIME then: a wall clock set back since
// is told from it.
type FirstStart struct {
	At       time.Time     `json:"at"`
	BootID   string        `json:"bootID"`
	BootTime time.Duration `json:"bootTime"`
}

// Since is the first start on today's wall clock: earlier by as much as
// the clock is set back since (a namespace made after the first start
// then shows a time before it); zero when unknown, which nothing
// precedes. Wall clocks only: with Go's monotonic readings, Sub would
// not see a step.
func (f FirstStart) Since(now time.Time, bootTime time.Duration) time.Time {
	if f.At.IsZero() {
		return time.Time{}
	}
	setBack := f.At.Round(0).Add(-f.BootTime).Sub(now.Round(0).Add(-bootTime))
	if setBack > 0 {
		return f.At.Add(-setBack)
	}
	return f.At
}

// firstStart returns the record of this boot's first start, writing one
// for now when there is none (or one of an earlier boot: the folder was
// not cleared). A record that cannot be read or written gives an error
// and the zero record: a later agent must never record a later start.
func (s *store) firstStart(now FirstStart) (FirstStart, error) {
	path := filepath.Join(s.dir, firstStartFile)
	b, err := os.ReadFile(path)
	switch {
	case err == nil:
		var f FirstStart
		if err := json.Unmarshal(b, &f); err != nil || f.At.IsZero() {
			return FirstStart{}, fmt.Errorf("%s does not read (%v); once it is removed, the next agent's start is recorded as the first (the in-pod mode may then take a pod started before it for one that predates the plugin)", path, err)
		}
		if f.BootID == now.BootID {
			return f, nil
		}
	case !errors.Is(err, os.ErrNotExist):
		return FirstStart{}, err
	}
	b, err = json.Marshal(now)
	if err == nil {
		err = os.MkdirAll(s.dir, 0o700)
	}
	if err == nil {
		err = atomicfile.Write(path, b, 0o600)
	}
	if err != nil {
		return FirstStart{}, err
	}
	return now, nil
}
