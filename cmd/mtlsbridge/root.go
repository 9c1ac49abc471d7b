// SPDX-License-Identifier: Apache-2.0

package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"runtime/debug"
	"strings"
	"syscall"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/shell"
	"github.com/spf13/cobra"

	"github.com/mtlsbridge/mtlsbridge/agent"
	"github.com/mtlsbridge/mtlsbridge/api/client"
	"github.com/mtlsbridge/mtlsbridge/statedir"
)

func rootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:           "mtlsbridge",
		Short:         "Transparent, identity-based mTLS for Cilium clusters through a node mTLS agent",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.AddCommand(agentCmd(), signerCmd(), dbCmd(), caCmd(), bypassCmd(), healthCmd(), shellCmd(), versionCmd())
	return root
}

func agentCmd() *cobra.Command {
	return hiveCmd("agent", "Run the node agent", agent.Cell)
}

func signerCmd() *cobra.Command {
	return hiveCmd("signer", "Run the signer: the one holder of the CA key, for node agents run with --ca-upstream", agent.SignerCell)
}

// hiveCmd runs a hive of cells on the infrastructure.
func hiveCmd(use, short string, cells cell.Cell) *cobra.Command {
	// Start-up steps are logged at debug level, unless one is slow.
	opts := hive.DefaultOptions()
	opts.LogThreshold = 100 * time.Millisecond
	h := hive.NewWithOptions(opts, agent.Infrastructure, cells)
	var debugLogs bool
	cmd := &cobra.Command{
		Use:   use,
		Short: short,
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			level := slog.LevelInfo
			if debugLogs {
				level = slog.LevelDebug
			}
			log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
			lock, err := lockStateDir(cmd, log)
			if err != nil {
				return err
			}
			defer lock.Release()
			return h.Run(log)
		},
	}
	h.RegisterFlags(cmd.Flags())
	cmd.Flags().BoolVar(&debugLogs, "debug", false, "Log at debug level")
	return cmd
}

// lockStateDir takes the state folder before the hive touches anything in
// it, waiting (and saying so) while another agent holds it; a signal stops
// the wait.
func lockStateDir(cmd *cobra.Command, log *slog.Logger) (*statedir.Lock, error) {
	dir, err := cmd.Flags().GetString(statedir.Flag)
	if err != nil {
		return nil, err
	}
	if err := statedir.Prepare(dir); err != nil {
		return nil, fmt.Errorf("--%s: %w", statedir.Flag, err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	return statedir.LockStateDir(ctx, dir, log)
}

// stateDirFlag adds --state-dir to a client command.
func stateDirFlag(cmd *cobra.Command, persistent bool) *string {
	flags := cmd.Flags()
	if persistent {
		flags = cmd.PersistentFlags()
	}
	return flags.String(statedir.Flag, statedir.DefaultConfig.StateDir, "State folder of the agent")
}

func shellCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "shell [COMMAND [ARGS...]]",
		Short: "The agent's read-only shell (db, db/show, db/get, health, redirect/map, help, ...); interactive without a command",
	}
	stateDir := stateDirFlag(cmd, false)
	cmd.RunE = func(cmd *cobra.Command, args []string) error {
		if len(args) > 0 {
			return client.Shell(cmd.Context(), *stateDir, cmd.OutOrStdout(), strings.Join(args, " "))
		}
		// hive's interactive client retries its dial for a while: fail at
		// once, as every other command does, when no agent serves.
		if err := client.CheckShell(cmd.Context(), *stateDir); err != nil {
			return err
		}
		interactive := shell.ShellCmd(client.ShellSocketPath(*stateDir), "mtlsbridge> ", nil)
		interactive.Run(interactive, nil)
		return nil
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
