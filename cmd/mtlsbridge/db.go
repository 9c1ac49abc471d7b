// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"

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

	var output string
	show := &cobra.Command{
		Use:   "show TABLE",
		Short: "Print one table (-o table|json)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return showTable(cmd, *stateDir, args[0], output)
		},
	}
	show.Flags().StringVarP(&output, "output", "o", "table", "Output format: table or json")

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

// showTable runs the shell's db/show and prints its rows, as a table or as
// a JSON array of row objects.
func showTable(cmd *cobra.Command, stateDir, table, output string) error {
	ctx, w := cmd.Context(), cmd.OutOrStdout()
	switch output {
	case "table":
		return client.Shell(ctx, stateDir, w, "db/show "+table)
	case "json":
		var buf bytes.Buffer
		if err := client.Shell(ctx, stateDir, &buf, "db/show --format=json "+table); err != nil {
			return err
		}
		rows := []json.RawMessage{}
		dec := json.NewDecoder(&buf)
		for {
			var row json.RawMessage
			if err := dec.Decode(&row); errors.Is(err, io.EOF) {
				break
			} else if err != nil {
				return fmt.Errorf("agent answered with malformed JSON: %w", err)
			}
			rows = append(rows, row)
		}
		out, err := json.MarshalIndent(rows, "", "  ")
		if err != nil {
			return err
		}
		_, err = fmt.Fprintf(w, "%s\n", out)
		return err
	}
	return fmt.Errorf("--output=%q: want table or json", output)
}
