// SPDX-License-Identifier: Apache-2.0

package main

import (
	"errors"
	"fmt"
	"path/filepath"

	"github.com/spf13/cobra"

	"github.com/mtlsbridge/mtlsbridge/identity"
	"github.com/mtlsbridge/mtlsbridge/spiffe"
)

// caCmd rotates the root of a CA folder. The agent picks changes up within
// --ca-reload-interval.
func caCmd() *cobra.Command {
	var caDir, trustDomain string
	var stateDir *string
	dir := func() string {
		if caDir != "" {
			return caDir
		}
		return filepath.Join(*stateDir, "ca")
	}
	cmd := &cobra.Command{
		Use:   "ca",
		Short: "Rotate the root of the certificate authority (CA folder)",
	}
	stateDir = stateDirFlag(cmd, true)
	cmd.PersistentFlags().StringVar(&caDir, "ca-dir", "", "CA folder, when not STATE_DIR/ca")
	rotate := &cobra.Command{
		Use:   "rotate",
		Short: "Advance a rotation: first a new root is trusted, run again it signs",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := spiffe.ValidateTrustDomain(trustDomain); err != nil {
				return fmt.Errorf("--trust-domain: %w", err)
			}
			step, err := identity.RotateDir(dir(), trustDomain)
			if err != nil {
				return err
			}
			switch step {
			case identity.RootTrusted:
				fmt.Fprintf(cmd.OutOrStdout(), "New root in %s trusted; the current one still signs. "+
					"Once every mTLS agent has the new bundle, run `mtlsbridge ca rotate` again.\n",
					filepath.Join(dir(), identity.NextCACertFile))
			case identity.RootSigning:
				fmt.Fprintf(cmd.OutOrStdout(), "The new root signs in %s; the previous one stays trusted until `mtlsbridge ca retire`.\n", dir())
			}
			return nil
		},
	}
	rotate.Flags().StringVar(&trustDomain, "trust-domain", spiffe.DefaultTrustDomain, "Trust domain of the new root")
	retire := &cobra.Command{
		Use:   "retire",
		Short: "End a rotation: only the signing root stays trusted",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := identity.RetireDir(dir()); errors.Is(err, identity.ErrNothingToRetire) {
				fmt.Fprintf(cmd.OutOrStdout(), "Nothing to retire: %s trusts only its signing root (no rotation in progress).\n", dir())
				return nil
			} else if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "Older roots retired in %s.\n", dir())
			return nil
		},
	}
	cmd.AddCommand(rotate, retire)
	return cmd
}
