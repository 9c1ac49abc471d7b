// SPDX-License-Identifier: Apache-2.0

package main

import (
	"errors"
	"fmt"
	"path/filepath"

	"github.com/spf13/cobra"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/mtlsbridge/mtlsbridge/identity"
	"github.com/mtlsbridge/mtlsbridge/spiffe"
)

// caCmd rotates the root of a CA folder, or of the signer's Secret with the
// nodes' roots ConfigMap. The agent picks changes up within
// --ca-reload-interval.
func caCmd() *cobra.Command {
	var caDir, trustDomain, secret, rootsConfigMap, kubeconfig string
	var stateDir *string
	dir := func() string {
		if caDir != "" {
			return caDir
		}
		return filepath.Join(*stateDir, "ca")
	}
	where := func() string {
		if secret != "" {
			return "Secret " + secret
		}
		return dir()
	}
	// kube is the admin's client, for --secret.
	kube := func() (kubernetes.Interface, error) {
		rules := clientcmd.NewDefaultClientConfigLoadingRules()
		rules.ExplicitPath = kubeconfig
		cfg, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{}).ClientConfig()
		if err != nil {
			return nil, fmt.Errorf("kubeconfig: %w", err)
		}
		return kubernetes.NewForConfig(cfg)
	}
	cmd := &cobra.Command{
		Use:   "ca",
		Short: "Rotate the root of the certificate authority (CA folder, or the signer's Secret)",
	}
	stateDir = stateDirFlag(cmd, true)
	cmd.PersistentFlags().StringVar(&caDir, "ca-dir", "", "CA folder, when not STATE_DIR/ca")
	cmd.PersistentFlags().StringVar(&secret, "secret", "", "NAMESPACE/NAME of the signer's CA Secret, to work on instead of a folder (e.g. kube-system/mtlsbridge-ca)")
	cmd.PersistentFlags().StringVar(&rootsConfigMap, "roots-configmap", "kube-system/mtlsbridge-ca-roots",
		"With --secret: NAMESPACE/NAME of the nodes' roots ConfigMap, kept in step with the Secret")
	cmd.PersistentFlags().StringVar(&kubeconfig, "kubeconfig", "", "With --secret: kubeconfig file (default: $KUBECONFIG, else ~/.kube/config)")
	rotate := &cobra.Command{
		Use:   "rotate",
		Short: "Advance a rotation: first a new root is trusted, run again it signs",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			err := spiffe.ValidateTrustDomain(trustDomain)
			if err != nil {
				return fmt.Errorf("--trust-domain: %w", err)
			}
			var step identity.RotationStep
			if secret == "" {
				step, err = identity.RotateDir(dir(), trustDomain)
			} else if client, kerr := kube(); kerr != nil {
				err = kerr
			} else {
				step, err = identity.RotateSecret(cmd.Context(), client, secret, rootsConfigMap, trustDomain)
			}
			if err != nil {
				return err
			}
			switch step {
			case identity.RootTrusted:
				fmt.Fprintf(cmd.OutOrStdout(), "New root in %s (%s) trusted; the current one still signs. "+
					"Once every mTLS agent has the new bundle, run `mtlsbridge ca rotate` again.\n",
					where(), identity.NextCACertFile)
			case identity.RootSigning:
				fmt.Fprintf(cmd.OutOrStdout(), "The new root signs in %s; the previous one stays trusted until `mtlsbridge ca retire`.\n", where())
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
			var err error
			if secret == "" {
				err = identity.RetireDir(dir())
			} else if client, kerr := kube(); kerr != nil {
				err = kerr
			} else {
				err = identity.RetireSecret(cmd.Context(), client, secret, rootsConfigMap)
			}
			if errors.Is(err, identity.ErrNothingToRetire) {
				fmt.Fprintf(cmd.OutOrStdout(), "Nothing to retire: %s trusts only its signing root (no rotation in progress).\n", where())
				return nil
			} else if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "Older roots retired in %s.\n", where())
			return nil
		},
	}
	initCmd := &cobra.Command{
		Use:   "init",
		Short: "Create the signer's CA Secret with a new root, and the nodes' roots ConfigMap (--secret)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if secret == "" {
				return errors.New("--secret is required: a CA folder is created by the agent at its first start")
			}
			if err := spiffe.ValidateTrustDomain(trustDomain); err != nil {
				return fmt.Errorf("--trust-domain: %w", err)
			}
			client, err := kube()
			if err != nil {
				return err
			}
			created, err := identity.InitSecret(cmd.Context(), client, secret, rootsConfigMap, trustDomain)
			if err != nil {
				return err
			}
			if created {
				fmt.Fprintf(cmd.OutOrStdout(), "Created Secret %s with a new root of trust domain %s, and its roots in ConfigMap %s.\n", secret, trustDomain, rootsConfigMap)
			} else {
				fmt.Fprintf(cmd.OutOrStdout(), "Secret %s exists and is kept; ConfigMap %s holds its roots.\n", secret, rootsConfigMap)
			}
			return nil
		},
	}
	initCmd.Flags().StringVar(&trustDomain, "trust-domain", spiffe.DefaultTrustDomain, "Trust domain of the new root")
	cmd.AddCommand(initCmd, rotate, retire)
	return cmd
}
