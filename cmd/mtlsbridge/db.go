// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"time"

	"github.com/cilium/hive/shell"
	"github.com/spf13/cobra"

	"github.com/mtlsbridge/mtlsbridge/api"
)

func dbCmd() *cobra.Command {
	var stateDir string
	cmd := &cobra.Command{
		Use:   "db",
		Short: "Show the tables of a running agent",
	}
	cmd.PersistentFlags().StringVar(&stateDir, api.StateDirFlag, api.DefaultConfig.StateDir, "State folder of the agent")

	var output string
	show := &cobra.Command{
		Use:   "show TABLE",
		Short: "Print one table (-o table|json)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return showTable(cmd.OutOrStdout(), stateDir, args[0], output)
		},
	}
	show.Flags().StringVarP(&output, "output", "o", "table", "Output format: table or json")

	dump := &cobra.Command{
		Use:   "dump",
		Short: "Print every table as JSON (statedb's HTTP dump)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return dumpTables(cmd.Context(), cmd.OutOrStdout(), stateDir)
		},
	}
	cmd.AddCommand(show, dump)
	return cmd
}

// errAgentUnreachable explains the usual cause of a failed dial.
var errAgentUnreachable = errors.New("is `mtlsbridge agent` running with the same --state-dir?")

func checkReachable(sock string) error {
	conn, err := net.DialTimeout("unix", sock, 2*time.Second)
	if err != nil {
		return fmt.Errorf("cannot reach the agent at %s: %w (%w)", sock, err, errAgentUnreachable)
	}
	return conn.Close()
}

// showTable runs the shell's db/show and prints its rows, as a table or as
// a JSON array of row objects.
func showTable(w io.Writer, stateDir, table, output string) error {
	sock := api.ShellSocketPath(stateDir)
	if err := checkReachable(sock); err != nil {
		return err
	}
	cfg := shell.Config{ShellSockPath: sock}
	switch output {
	case "table":
		return shell.ShellExchange(cfg, w, "db/show %s", table)
	case "json":
		var buf bytes.Buffer
		if err := shell.ShellExchange(cfg, &buf, "db/show --format=json %s", table); err != nil {
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

// dumpTables prints statedb's HTTP dump of every table.
func dumpTables(ctx context.Context, w io.Writer, stateDir string) error {
	sock := api.SocketPath(stateDir)
	if err := checkReachable(sock); err != nil {
		return err
	}
	client := &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", sock)
		},
	}}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://agent"+api.StatedbPrefix+"/dump", nil)
	if err != nil {
		return err
	}
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("agent answered %s", resp.Status)
	}
	_, err = io.Copy(w, resp.Body)
	return err
}
