// SPDX-License-Identifier: Apache-2.0

package main

import (
	"fmt"
	"log/slog"
	"os"
	"runtime/debug"

	"github.com/cilium/hive"
	"github.com/cilium/hive/shell"
	"github.com/spf13/cobra"

	"github.com/mtlsbridge/mtlsbridge/agent"
	"github.com/mtlsbridge/mtlsbridge/api"
)

func rootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:           "mtlsbridge",
		Short:         "Transparent, identity-based mTLS for Cilium clusters through a node mTLS agent",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.AddCommand(agentCmd(), dbCmd(), caCmd(), bypassCmd(), shellCmd(), versionCmd())
	return root
}

func agentCmd() *cobra.Command {
	h := hive.New(agent.Infrastructure, agent.Cell)
	var debugLogs bool
	cmd := &cobra.Command{
		Use:   "agent",
		Short: "Run the node agent",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			flags := cmd.Flags()
			if !flags.Changed(shell.ShellSockPathName) {
				stateDir, _ := flags.GetString(api.StateDirFlag)
				if err := flags.Set(shell.ShellSockPathName, api.ShellSocketPath(stateDir)); err != nil {
					return err
				}
			}
			level := slog.LevelInfo
			if debugLogs {
				level = slog.LevelDebug
			}
			log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
			return h.Run(log)
		},
	}
	h.RegisterFlags(cmd.Flags())
	cmd.Flags().BoolVar(&debugLogs, "debug", false, "Log at debug level")
	return cmd
}

func shellCmd() *cobra.Command {
	cmd := shell.ShellCmd(api.ShellSocketPath(api.DefaultConfig.StateDir), "mtlsbridge> ", nil)
	stateDir := cmd.Flags().String(api.StateDirFlag, api.DefaultConfig.StateDir, "State folder of the agent")
	cmd.Short = "Open the agent's hive shell (all script commands: db/show, health, ...)"
	run := cmd.Run
	cmd.Run = func(c *cobra.Command, args []string) {
		if !c.Flags().Changed(shell.ShellSockPathName) {
			c.Flags().Set(shell.ShellSockPathName, api.ShellSocketPath(*stateDir))
		}
		run(c, args)
	}
	return cmd
}

func versionCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print the version",
		Args:  cobra.NoArgs,
		Run: func(cmd *cobra.Command, _ []string) {
			version, revision := "(devel)", "unknown"
			goVersion := ""
			if bi, ok := debug.ReadBuildInfo(); ok {
				goVersion = bi.GoVersion
				if bi.Main.Version != "" {
					version = bi.Main.Version
				}
				for _, s := range bi.Settings {
					if s.Key == "vcs.revision" {
						revision = s.Value
					}
				}
			}
			fmt.Fprintf(cmd.OutOrStdout(), "mtlsbridge %s (revision %s, %s)\n", version, revision, goVersion)
		},
	}
}
