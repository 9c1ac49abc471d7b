// SPDX-License-Identifier: Apache-2.0

package inpod

import (
	"github.com/cilium/hive"
	"github.com/cilium/hive/script"
	"github.com/cilium/statedb/reconciler"
)

// scriptCommands: inpod/prune removes now, rather than at the next prune
// interval, the redirections no enrolled pod asks for.
func scriptCommands(r reconciler.Reconciler[*Redirection]) hive.ScriptCmdsOut {
	return hive.NewScriptCmds(map[string]script.Cmd{
		"inpod/prune": script.Command(
			script.CmdUsage{Summary: "Prune the in-pod redirections no enrolled pod asks for, now"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				r.Prune()
				return nil, nil
			}),
	})
}
