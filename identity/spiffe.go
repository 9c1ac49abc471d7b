// SPDX-License-Identifier: Apache-2.0

// Package identity builds and checks the SPIFFE identities of workloads.
package identity

import (
	"fmt"
	"strconv"
)

// DefaultTrustDomain is Kubernetes' and Istio's default trust domain.
const DefaultTrustDomain = "cluster.local"

// WorkloadID is the Istio-scheme SPIFFE ID of a pod's service account:
// spiffe://TD/ns/NAMESPACE/sa/SERVICEACCOUNT.
func WorkloadID(trustDomain, namespace, serviceAccount string) string {
	return "spiffe://" + trustDomain + "/ns/" + namespace + "/sa/" + serviceAccount
}

// CiliumIdentityID is the SPIFFE ID of a Cilium security identity, the
// scheme Cilium's mutual authentication uses: spiffe://TD/identity/N.
func CiliumIdentityID(trustDomain string, identity uint32) string {
	return "spiffe://" + trustDomain + "/identity/" + strconv.FormatUint(uint64(identity), 10)
}

// ValidateTrustDomain checks a trust domain name as the SPIFFE ID standard
// defines it: lower-case letters, digits, dots, dashes and underscores.
func ValidateTrustDomain(td string) error {
	if td == "" {
		return fmt.Errorf("trust domain is empty")
	}
	for _, c := range td {
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '.' || c == '-' || c == '_') {
			return fmt.Errorf("trust domain %q: character %q not allowed (want lower-case letters, digits, '.', '-', '_')", td, c)
		}
	}
	return nil
}
