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
	"github.com/mtlsbridge/mtlsbridge/tables"
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
	// MTLSAgentNamespaces are where a pod labelled cilium.io/redir-type=proxy
	// is its node's mTLS agent (flag --mtls-agent-namespaces). Any pod
	// owner can set the label: elsewhere it makes no agent.
	MTLSAgentNamespaces []string
	// ClusterName is Cilium's name of this cluster, the value of the
	// io.cilium.k8s.policy.cluster pseudo label policies select on (flag
	// --cluster-name, as Cilium's).
	ClusterName string
}

var defaultConfig = Config{
	TrustDomain:         spiffe.DefaultTrustDomain,
	ExcludedNamespaces:  []string{"kube-system"},
	MTLSAgentNamespaces: []string{"kube-system"},
	ClusterName:         "default",
}

// Flags implements cell.Flagger.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.String("trust-domain", def.TrustDomain, "SPIFFE trust domain of workload identities")
	flags.StringSlice("excluded-namespaces", def.ExcludedNamespaces, "Namespaces whose pods are never enrolled")
	flags.StringSlice("mtls-agent-namespaces", def.MTLSAgentNamespaces,
		"Namespaces where a pod labelled cilium.io/redir-type=proxy is its node's mTLS agent (the label is ignored elsewhere)")
	flags.String("cluster-name", def.ClusterName, "Cilium's cluster name (its --cluster-name): policies select it as io.cilium.k8s.policy.cluster")
}

func (c Config) excluded(namespace string) bool {
	return slices.Contains(c.ExcludedNamespaces, namespace)
}

// MTLSAgent reports whether pod is trusted as its node's mTLS agent: it
// carries the label, in one of MTLSAgentNamespaces.
func (c Config) MTLSAgent(pod *tables.Pod) bool {
	return pod.Labels.Get(tables.RedirTypeLabel) == tables.RedirTypeProxy && slices.Contains(c.MTLSAgentNamespaces, pod.Namespace)
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
