// SPDX-License-Identifier: Apache-2.0

// Package manifesttest changes a manifest folder (--source=dir:PATH) the
// way an editor or a deploy tool does: whole files, replaced by rename.
package manifesttest

import (
	"context"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/script"
	"github.com/spf13/pflag"
)

// Write replaces the file name in dir with content atomically.
func Write(dir, name string, content []byte) error {
	tmp := filepath.Join(dir, ".tmp-"+name)
	if err := os.WriteFile(tmp, content, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, filepath.Join(dir, name))
}

// ScriptCommands are manifests/write and manifests/rm for script tests of an
// agent reading dir.
func ScriptCommands(dir string) map[string]script.Cmd {
	return map[string]script.Cmd{
		"manifests/write": script.Command(
			script.CmdUsage{Summary: "copy files of the script into the manifest folder (by rename), the last optionally under another name", Args: "file... [--as=NAME]"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) == 0 {
					return nil, script.ErrUsage
				}
				as := ""
				if last, ok := strings.CutPrefix(args[len(args)-1], "--as="); ok {
					as, args = last, args[:len(args)-1]
				}
				if len(args) == 0 || (as != "" && len(args) != 1) {
					return nil, script.ErrUsage
				}
				for _, name := range args {
					content, err := os.ReadFile(s.Path(name))
					if err != nil {
						return nil, err
					}
					target := filepath.Base(name)
					if as != "" {
						target = as
					}
					if err := Write(dir, target, content); err != nil {
						return nil, err
					}
				}
				return nil, nil
			}),
		"manifests/rm": script.Command(
			script.CmdUsage{Summary: "remove files from the manifest folder", Args: "name..."},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				for _, name := range args {
					if err := os.Remove(filepath.Join(dir, name)); err != nil {
						return nil, fmt.Errorf("manifests/rm: %w", err)
					}
				}
				return nil, nil
			}),
	}
}

// NewEngine is the script engine of a hive that reads the manifest folder
// dir: it parses args as h's flags (after --source=dir:DIR), offers the
// hive's commands, the default ones, the manifest ones and extra, and stops
// h when the test ends. Scripts start the hive themselves (hive start).
func NewEngine(t testing.TB, h *hive.Hive, dir string, args []string, extra map[string]script.Cmd) *script.Engine {
	log := hivetest.Logger(t)
	flags := pflag.NewFlagSet("", pflag.ContinueOnError)
	h.RegisterFlags(flags)
	if err := flags.Parse(append([]string{"--source=dir:" + dir}, args...)); err != nil {
		t.Fatalf("flags %v: %s", args, err)
	}
	cmds, err := h.ScriptCommands(log)
	if err != nil {
		t.Fatal(err)
	}
	maps.Insert(cmds, maps.All(script.DefaultCmds()))
	maps.Insert(cmds, maps.All(ScriptCommands(dir)))
	maps.Insert(cmds, maps.All(extra))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		h.Stop(log, ctx)
	})
	return &script.Engine{Cmds: cmds}
}
