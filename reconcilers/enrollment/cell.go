// SPDX-License-Identifier: Apache-2.0

// Package enrollment derives, for every pod, whether it is enrolled for mTLS
// and why, incrementally from the pods, namespaces and policies tables.
package enrollment

import (
	"fmt"
	"slices"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"

	"github.com/mtlsbridge/mtlsbridge/spiffe"
)

// Cell provides the enrollments table and keeps it derived.
var Cell = cell.Module(
	"enrollment",
	"Which pods are enrolled for mTLS and why",

	cell.Config(defaultConfig),
	// The derivation is the table's only writer.
	cell.ProvidePrivate(NewTable),
	cell.Provide(statedb.RWTable[*Enrollment].ToTable),
	cell.Invoke(registerDerivation),
)

// Config of the enrollment rules.
type Config struct {
	// TrustDomain of the SPIFFE IDs (flag --trust-domain).
	TrustDomain string
	// ExcludedNamespaces are never enrolled (flag --excluded-namespaces).
	ExcludedNamespaces []string
}

var defaultConfig = Config{
	TrustDomain:        spiffe.DefaultTrustDomain,
	ExcludedNamespaces: []string{"kube-system"},
}

// Flags implements cell.Flagger.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.String("trust-domain", def.TrustDomain, "SPIFFE trust domain of workload identities")
	flags.StringSlice("excluded-namespaces", def.ExcludedNamespaces, "Namespaces whose pods are never enrolled")
}

func (c Config) excluded(namespace string) bool {
	return slices.Contains(c.ExcludedNamespaces, namespace)
}

func (c Config) validate() error {
	if err := spiffe.ValidateTrustDomain(c.TrustDomain); err != nil {
		return fmt.Errorf("--trust-domain: %w", err)
	}
	return nil
}

func registerDerivation(p derivationParams) error {
	if err := p.Config.validate(); err != nil {
		return err
	}
	d, err := newDerivation(p)
	if err != nil {
		return err
	}
	p.Jobs.NewGroup(p.Health).Add(job.OneShot("derive-enrollments", d.run))
	return nil
}
