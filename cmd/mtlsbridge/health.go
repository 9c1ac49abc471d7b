// SPDX-License-Identifier: Apache-2.0

package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"

	"github.com/spf13/cobra"

	"github.com/mtlsbridge/mtlsbridge/api"
	"github.com/mtlsbridge/mtlsbridge/api/client"
)

// errNotReady makes `mtlsbridge health` exit 1: the form a kubelet's exec
// probe understands.
var errNotReady = errors.New("the agent is not ready")

func healthCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "health",
		Short: "Print the agent's readiness (/healthz); exit 1 unless ready",
		Long: "Ready means: every table initialized (sources synced, every enrolled pod of the node\n" +
			"redirected once) and every dependency of the node's service working (CA material,\n" +
			"token reviews, the readiness taint's removal). Warnings do not make it unready.",
		Args: cobra.NoArgs,
	}
	stateDir := stateDirFlag(cmd, false)
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		resp, err := client.New(*stateDir).Do(cmd.Context(), http.MethodGet, "/healthz", "", nil)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		var h api.Health
		if err := json.NewDecoder(resp.Body).Decode(&h); err != nil {
			return fmt.Errorf("agent answered %s with malformed JSON: %w", resp.Status, err)
		}
		out, _ := json.MarshalIndent(h, "", "  ")
		fmt.Fprintf(cmd.OutOrStdout(), "%s\n", out)
		if !h.Ready {
			return errNotReady
		}
		return nil
	}
	return cmd
}
