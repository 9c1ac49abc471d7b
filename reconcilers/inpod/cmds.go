// SPDX-License-Identifier: Apache-2.0

package inpod

import (
	"github.com/cilium/hive"
	"github.com/cilium/hive/script"
	"github.com/cilium/statedb/reconciler"
)

// scriptCommands: inpod/prune removes now, rather than at the next prune
// interval, the redirections no enrolled pod asks for, and reads the
// node's probe SNAT again (after repairs by hand).
func scriptCommands(r reconciler.Reconciler[*Redirection], probes *probeSNAT) hive.ScriptCmdsOut {
	return hive.NewScriptCmds(map[string]script.Cmd{
		"inpod/prune": script.Command(
			script.CmdUsage{Summary: "Prune the in-pod redirections no enrolled pod asks for, and check the node's probe SNAT, now"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				r.Prune()
				probes.check()
				return nil, nil
			}),
	})
}
