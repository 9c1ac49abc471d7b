// SPDX-License-Identifier: Apache-2.0

package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/mtlsbridge/mtlsbridge/api/client"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/bypass"
)

// errBypassing is returned when at least one enrolled pod bypasses the
// mTLS agent: the command exits 1.
var errBypassing = errors.New("enrolled pods bypass the mTLS agent")

func bypassCmd() *cobra.Command {
	var output string
	var stateDir *string
	cmd := &cobra.Command{
		Use:   "bypass",
		Short: "Check the kernel for enrolled pods of this node that bypass the mTLS agent (exit 1 if any)",
		Long: "Asks the running agent to check now, for every pod of this node that the rules enroll, the real\n" +
			"kernel state: redirect entry present and pointing at the pod's interface, from-pod program attached\n" +
			"and first on it, agent entry present and its interface up, and the pod's Workload acknowledged with\n" +
			"HBONE by the mTLS agent. Lists each gap with its reason; exits 1 when any pod bypasses.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runBypass(cmd.Context(), cmd.OutOrStdout(), *stateDir, output)
		},
	}
	stateDir = stateDirFlag(cmd, false)
	cmd.Flags().StringVarP(&output, "output", "o", "table", "Output format: table or json")
	return cmd
}

// runBypass asks the agent for a check and prints it. It returns an error
// wrapping errBypassing when a pod bypasses, after printing the report.
func runBypass(ctx context.Context, w io.Writer, stateDir, output string) error {
	if output != "table" && output != "json" {
		return fmt.Errorf("--output=%q: want table or json", output)
	}
	rep, err := fetchBypass(ctx, stateDir)
	if err != nil {
		return err
	}
	if output == "json" {
		out, err := json.MarshalIndent(rep, "", "  ")
		if err != nil {
			return err
		}
		if _, err := fmt.Fprintf(w, "%s\n", out); err != nil {
			return err
		}
	} else if err := printBypass(w, rep); err != nil {
		return err
	}
	if rep.Bypassing > 0 {
		return fmt.Errorf("%d of %d: %w", rep.Bypassing, len(rep.Pods), errBypassing)
	}
	return nil
}

func fetchBypass(ctx context.Context, stateDir string) (bypass.Report, error) {
	var rep bypass.Report
	err := client.New(stateDir).GetJSON(ctx, bypass.APIPath, &rep)
	return rep, err
}

// printBypass prints one line per gap, the pod named on its first.
func printBypass(w io.Writer, rep bypass.Report) error {
	tw := tabwriter.NewWriter(w, 0, 8, 2, ' ', 0)
	// The headers of db show bypass.
	fmt.Fprintln(tw, "Pod\tBypassing\tGaps")
	for _, p := range rep.Pods {
		gaps := p.Gaps
		if len(gaps) == 0 {
			gaps = []string{"-"}
		}
		for i, g := range gaps {
			if i == 0 {
				fmt.Fprintf(tw, "%s\t%s\t%s\n", p.Pod, strconv.FormatBool(p.Bypassing), g)
			} else {
				fmt.Fprintf(tw, "\t\t%s\n", g)
			}
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err := fmt.Fprintf(w, "%d of %d enrolled pods bypassing\n", rep.Bypassing, len(rep.Pods))
	return err
}
