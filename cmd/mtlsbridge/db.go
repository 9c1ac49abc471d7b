// SPDX-License-Identifier: Apache-2.0

package main

import (
	"io"
	"net/http"
	"strings"

	"github.com/spf13/cobra"

	"github.com/mtlsbridge/mtlsbridge/api"
	"github.com/mtlsbridge/mtlsbridge/api/client"
)

func dbCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "db",
		Short: "Show the tables of a running agent",
	}
	stateDir := stateDirFlag(cmd, true)

	var (
		output               string
		namespace, pod, node string
		watch                bool
	)
	show := &cobra.Command{
		Use:   "show [TABLE]",
		Short: "Print a table's rows (-o table|json|yaml), filtered by --namespace, --pod, --node; -w follows changes; no TABLE lists the tables",
		Args:  cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			line := []string{api.ShowCommand, "--output=" + output}
			for flag, v := range map[string]string{"namespace": namespace, "pod": pod, "node": node} {
				if v != "" {
					line = append(line, "--"+flag+"="+v)
				}
			}
			if watch {
				line = append(line, "--watch")
			}
			return client.Shell(cmd.Context(), *stateDir, cmd.OutOrStdout(), strings.Join(append(line, args...), " "))
		},
	}
	show.Flags().StringVarP(&output, "output", "o", "table", "Output format: table, json or yaml")
	show.Flags().StringVar(&namespace, "namespace", "", "Only rows of this namespace")
	show.Flags().StringVar(&pod, "pod", "", "Only rows of this pod (NAME with --namespace, or NAMESPACE/NAME)")
	show.Flags().StringVar(&node, "node", "", "Only rows of this node")
	show.Flags().BoolVarP(&watch, "watch", "w", false, "Go on printing the rows that change")

	dump := &cobra.Command{
		Use:   "dump",
		Short: "Print every table as JSON (statedb's HTTP dump)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			resp, err := client.New(*stateDir).Do(cmd.Context(), http.MethodGet, api.StatedbPrefix+"/dump", "", nil)
			if err != nil {
				return err
			}
			defer resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				return client.StatusError(resp)
			}
			_, err = io.Copy(cmd.OutOrStdout(), resp.Body)
			return err
		},
	}
	cmd.AddCommand(show, dump)
	return cmd
}
