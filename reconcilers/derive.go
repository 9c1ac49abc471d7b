// SPDX-License-Identifier: Apache-2.0

// Package reconcilers holds what the derivations of its subfolders share.
package reconcilers

import (
	"context"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
)

// RunDerivation runs a derivation until ctx ends: step processes every
// change committed so far and returns the channels that close when there is
// more to do; status describes the result for the health of the job.
func RunDerivation(ctx context.Context, health cell.Health, step func() []<-chan struct{}, status func() string) error {
	ws := statedb.NewWatchSet()
	for {
		ws.Clear()
		ws.Add(step()...)
		health.OK(status())
		if _, err := ws.Wait(ctx, 0); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
	}
}
