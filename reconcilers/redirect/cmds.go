// SPDX-License-Identifier: Apache-2.0

package redirect

import (
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"

	"github.com/cilium/hive"
	"github.com/cilium/hive/script"
)

// scriptCommands read the kernel state itself, not the tables: what is
// really in the map and on the devices (mtlsbridge shell, scripts).
func scriptCommands(dp Datapath) hive.ScriptCmdsOut {
	return hive.NewScriptCmds(map[string]script.Cmd{
		"redirect/map": script.Command(
			script.CmdUsage{Summary: "Show the entries of the pinned redirect map"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				entries, err := dp.Entries()
				if err != nil {
					return nil, err
				}
				var b strings.Builder
				for _, addr := range slices.SortedFunc(maps.Keys(entries), netip.Addr.Compare) {
					fmt.Fprintf(&b, "%s %s\n", addrString(addr), entries[addr])
				}
				return func(*script.State) (string, string, error) { return b.String(), "", nil }, nil
			}),
		"redirect/attached": script.Command(
			script.CmdUsage{Summary: "List the devices that have a program pinned by this agent"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				attached, err := dp.Attached()
				if err != nil {
					return nil, err
				}
				out := strings.Join(slices.Sorted(maps.Keys(attached)), "\n")
				if out != "" {
					out += "\n"
				}
				return func(*script.State) (string, string, error) { return out, "", nil }, nil
			}),
	})
}
