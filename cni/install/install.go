// SPDX-License-Identifier: Apache-2.0

// Package install puts the mtlsbridge-cni plugin into a node's CNI
// configuration and takes it out: the binary into the CNI bin folder, its
// entry last in the plugins of the chosen conflist. It imports nothing of
// the agent, so that the plugin binary can uninstall itself.
package install

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"sort"

	"github.com/mtlsbridge/mtlsbridge/cni/plugin"
	"github.com/mtlsbridge/mtlsbridge/internal/atomicfile"
)

// PluginType is the "type" of the entry, and the binary's name.
const PluginType = plugin.PluginType

// PreferredConflist is Cilium's own conflist, chosen when present.
const PreferredConflist = "05-cilium.conflist"

// ErrNoConflist: the folder holds no conflist to chain into (Cilium has not
// written its configuration yet).
var ErrNoConflist = errors.New("no *.conflist in the CNI configuration folder")

// FindConflist returns the conflist to chain into: name when set, else
// PreferredConflist when present, else the first *.conflist by name (the
// one the runtime uses).
//
// Possible errors: ErrNoConflist, or the folder cannot be read.
func FindConflist(confDir, name string) (string, error) {
	if name != "" {
		p := filepath.Join(confDir, name)
		if _, err := os.Stat(p); err != nil {
			if errors.Is(err, os.ErrNotExist) {
				return "", fmt.Errorf("%s: %w", p, ErrNoConflist)
			}
			return "", err
		}
		return p, nil
	}
	if _, err := os.Stat(filepath.Join(confDir, PreferredConflist)); err == nil {
		return filepath.Join(confDir, PreferredConflist), nil
	}
	matches, err := filepath.Glob(filepath.Join(confDir, "*.conflist"))
	if err != nil {
		return "", err
	}
	if len(matches) == 0 {
		return "", fmt.Errorf("%s: %w", confDir, ErrNoConflist)
	}
	sort.Strings(matches)
	return matches[0], nil
}

// InsertEntry makes entry the last plugin of the conflist at path, replacing
// any earlier entry of PluginType wherever it stood. It writes only when
// that changes the file (the caller watches the folder), atomically, and
// reports whether it wrote. Other fields of the conflist are kept.
func InsertEntry(path string, entry map[string]any) (bool, error) {
	return edit(path, func(plugins []any) []any {
		return append(withoutOurs(plugins), entry)
	})
}

// RemoveEntry takes every entry of PluginType out of the conflist at path.
// A missing file is not an error.
func RemoveEntry(path string) (bool, error) {
	changed, err := edit(path, withoutOurs)
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	return changed, err
}

// HasEntry reports whether the conflist at path has our entry last.
func HasEntry(path string) (bool, error) {
	conf, err := read(path)
	if err != nil {
		return false, err
	}
	plugins, _ := conf["plugins"].([]any)
	if len(plugins) == 0 {
		return false, nil
	}
	last, _ := plugins[len(plugins)-1].(map[string]any)
	return last["type"] == PluginType, nil
}

func withoutOurs(plugins []any) []any {
	return slices.DeleteFunc(slices.Clone(plugins), func(p any) bool {
		m, _ := p.(map[string]any)
		return m["type"] == PluginType
	})
}

func read(path string) (map[string]any, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var conf map[string]any
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber() // numbers come back out exactly as written
	if err := dec.Decode(&conf); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return conf, nil
}

func edit(path string, change func([]any) []any) (bool, error) {
	conf, err := read(path)
	if err != nil {
		return false, err
	}
	plugins, ok := conf["plugins"].([]any)
	if !ok {
		return false, fmt.Errorf("%s: no \"plugins\" list", path)
	}
	before, _ := json.Marshal(plugins)
	plugins = change(plugins)
	after, _ := json.Marshal(plugins)
	if bytes.Equal(before, after) {
		return false, nil
	}
	conf["plugins"] = plugins
	out, err := json.MarshalIndent(conf, "", "  ")
	if err != nil {
		return false, err
	}
	return true, atomicfile.Write(path, append(out, '\n'), 0o644)
}

// CopyBinary installs the plugin binary src as binDir/PluginType, unless
// an identical file is there already. Reports whether it wrote.
func CopyBinary(src, binDir string) (bool, error) {
	want, err := os.ReadFile(src)
	if err != nil {
		return false, fmt.Errorf("plugin binary: %w", err)
	}
	dst := filepath.Join(binDir, PluginType)
	if have, err := os.ReadFile(dst); err == nil && bytes.Equal(have, want) {
		return false, nil
	}
	if err := os.MkdirAll(binDir, 0o755); err != nil {
		return false, err
	}
	return true, atomicfile.Write(dst, want, 0o755)
}

// RemoveBinary deletes binDir/PluginType; a missing file is not an error.
func RemoveBinary(binDir string) error {
	err := os.Remove(filepath.Join(binDir, PluginType))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	return err
}

// Uninstall is the explicit removal: the entry out of every conflist of
// confDir, then the binary. Until it runs, a stopped agent keeps blocking
// the start of enrolled pods.
func Uninstall(confDir, binDir string, log io.Writer) error {
	matches, err := filepath.Glob(filepath.Join(confDir, "*.conflist"))
	if err != nil {
		return err
	}
	var errs []error
	for _, p := range matches {
		changed, err := RemoveEntry(p)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if changed {
			fmt.Fprintf(log, "removed %s from %s\n", PluginType, p)
		}
	}
	if err := RemoveBinary(binDir); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}
