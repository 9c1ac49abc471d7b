// SPDX-License-Identifier: Apache-2.0

// Package spiffe builds and checks the SPIFFE IDs of workloads in both
// schemes: spiffe://TD/ns/NAMESPACE/sa/SERVICEACCOUNT (Istio) and
// spiffe://TD/identity/N (Cilium security identities).
package spiffe

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// DefaultTrustDomain is Kubernetes' and Istio's default trust domain.
const DefaultTrustDomain = "cluster.local"

// WorkloadID is the Istio-scheme SPIFFE ID of a pod's service account:
// spiffe://TD/ns/NAMESPACE/sa/SERVICEACCOUNT.
func WorkloadID(trustDomain, namespace, serviceAccount string) string {
	return "spiffe://" + trustDomain + "/ns/" + namespace + "/sa/" + serviceAccount
}

// MinimalPodIdentity is the lowest Cilium security identity a pod gets;
// those below are reserved (host, world, init, remote-node, ...).
const MinimalPodIdentity = 256

// CiliumIdentityID is the SPIFFE ID of a Cilium security identity, the
// scheme Cilium's mutual authentication uses: spiffe://TD/identity/N.
func CiliumIdentityID(trustDomain string, identity uint32) string {
	return "spiffe://" + trustDomain + "/identity/" + strconv.FormatUint(uint64(identity), 10)
}

// ID is a parsed workload SPIFFE ID of either scheme.
type ID struct {
	TrustDomain string
	// Namespace and ServiceAccount are set for spiffe://TD/ns/NS/sa/SA.
	Namespace      string
	ServiceAccount string
	// CiliumIdentity is set for spiffe://TD/identity/N.
	CiliumIdentity uint32
}

// String renders the ID.
func (id ID) String() string {
	if id.CiliumIdentity != 0 {
		return CiliumIdentityID(id.TrustDomain, id.CiliumIdentity)
	}
	return WorkloadID(id.TrustDomain, id.Namespace, id.ServiceAccount)
}

// ErrNotWorkloadID is returned for a valid SPIFFE ID of neither scheme.
var ErrNotWorkloadID = errors.New("not a workload identity: want spiffe://TD/ns/NAMESPACE/sa/SERVICEACCOUNT or spiffe://TD/identity/N")

// ParseID parses a workload SPIFFE ID, checking the SPIFFE ID rules (scheme,
// trust domain characters, non-empty path segments without "." or "..", no
// query, fragment, port or user info).
func ParseID(s string) (ID, error) {
	rest, ok := strings.CutPrefix(s, "spiffe://")
	if !ok {
		return ID{}, fmt.Errorf("%q: not a SPIFFE ID (scheme must be spiffe://)", s)
	}
	td, path, _ := strings.Cut(rest, "/")
	if err := ValidateTrustDomain(td); err != nil {
		return ID{}, fmt.Errorf("%q: %w", s, err)
	}
	segments := strings.Split(path, "/")
	for _, seg := range segments {
		if err := validateSegment(seg); err != nil {
			return ID{}, fmt.Errorf("%q: %w", s, err)
		}
	}
	switch {
	case len(segments) == 4 && segments[0] == "ns" && segments[2] == "sa":
		return ID{TrustDomain: td, Namespace: segments[1], ServiceAccount: segments[3]}, nil
	case len(segments) == 2 && segments[0] == "identity":
		n, err := strconv.ParseUint(segments[1], 10, 32)
		if err != nil || n == 0 || strconv.FormatUint(n, 10) != segments[1] {
			return ID{}, fmt.Errorf("%q: identity %q is not a positive 32-bit number", s, segments[1])
		}
		return ID{TrustDomain: td, CiliumIdentity: uint32(n)}, nil
	}
	return ID{}, fmt.Errorf("%q: %w", s, ErrNotWorkloadID)
}

func validateSegment(seg string) error {
	if seg == "" || seg == "." || seg == ".." {
		return fmt.Errorf("path segment %q not allowed", seg)
	}
	for _, c := range seg {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '-' || c == '_') {
			return fmt.Errorf("character %q not allowed in path segment %q", c, seg)
		}
	}
	return nil
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
