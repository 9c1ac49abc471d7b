// SPDX-License-Identifier: Apache-2.0

package proxy

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"istio.io/istio/pkg/workloadapi/security"

	"github.com/mtlsbridge/mtlsbridge/spiffe"
)

// Connection is what an Authorization policy is matched against: an
// inbound connection after the mTLS handshake.
type Connection struct {
	Source      netip.AddrPort
	Destination netip.AddrPort
	// SourceIdentity is the SPIFFE ID of the client certificate.
	SourceIdentity string
}

// Decision is the outcome of Authorize, with the policy that decided.
type Decision struct {
	Allowed bool
	// Policy is "ns/name" of the deciding policy; empty when no policy
	// applies (allowed) or when ALLOW policies exist and none matched.
	Policy string
}

// Authorize applies policies as ztunnel does: a matching DENY refuses;
// otherwise, with no ALLOW policy the connection is allowed (any mesh
// identity: the handshake already proved one), else an ALLOW policy must
// match. Dry-run policies never decide.
func Authorize(policies []*security.Authorization, c Connection) Decision {
	anyAllow := false
	for _, p := range policies {
		if p.GetDryRun() || p.GetAction() != security.Action_DENY {
			continue
		}
		if policyMatches(p, c) {
			return Decision{Allowed: false, Policy: p.GetNamespace() + "/" + p.GetName()}
		}
	}
	for _, p := range policies {
		if p.GetDryRun() || p.GetAction() != security.Action_ALLOW {
			continue
		}
		anyAllow = true
		if policyMatches(p, c) {
			return Decision{Allowed: true, Policy: p.GetNamespace() + "/" + p.GetName()}
		}
	}
	return Decision{Allowed: !anyAllow}
}

// policyMatches: any group (ztunnel's rule) whose every rules entry
// (clause) has a matching, non-empty match. A policy without groups
// matches nothing.
func policyMatches(p *security.Authorization, c Connection) bool {
	for _, g := range p.GetGroups() {
		if groupMatches(g, c) {
			return true
		}
	}
	return false
}

func groupMatches(g *security.Group, c Connection) bool {
	for _, clause := range g.GetRules() {
		if len(clause.GetMatches()) == 0 {
			continue // an empty clause constrains nothing
		}
		if !slices.ContainsFunc(clause.GetMatches(), func(m *security.Match) bool { return matchMatches(m, c) }) {
			return false
		}
	}
	return true
}

// matchMatches: every field set must hold (any positive value, no negative
// one). A match with no field set matches nothing.
func matchMatches(m *security.Match, c Connection) bool {
	id, idErr := spiffe.ParseID(c.SourceIdentity)
	principal, _ := strings.CutPrefix(c.SourceIdentity, "spiffe://")
	if idErr != nil {
		principal = ""
	}
	fields := []bool{
		field(m.GetNamespaces(), m.GetNotNamespaces(), func(s *security.StringMatch) bool {
			return idErr == nil && stringMatches(s, id.Namespace)
		}),
		field(m.GetPrincipals(), m.GetNotPrincipals(), func(s *security.StringMatch) bool {
			return principal != "" && stringMatches(s, principal)
		}),
		field(m.GetServiceAccounts(), m.GetNotServiceAccounts(), func(s *security.ServiceAccountMatch) bool {
			return idErr == nil && id.Namespace == s.GetNamespace() && id.ServiceAccount == s.GetServiceAccount()
		}),
		field(m.GetSourceIps(), m.GetNotSourceIps(), func(a *security.Address) bool { return prefixContains(a, c.Source.Addr()) }),
		field(m.GetDestinationIps(), m.GetNotDestinationIps(), func(a *security.Address) bool {
			return prefixContains(a, c.Destination.Addr())
		}),
		field(m.GetDestinationPorts(), m.GetNotDestinationPorts(), func(p uint32) bool { return p == uint32(c.Destination.Port()) }),
	}
	empty := len(m.GetNamespaces())+len(m.GetNotNamespaces())+len(m.GetPrincipals())+len(m.GetNotPrincipals())+
		len(m.GetServiceAccounts())+len(m.GetNotServiceAccounts())+len(m.GetSourceIps())+len(m.GetNotSourceIps())+
		len(m.GetDestinationIps())+len(m.GetNotDestinationIps())+len(m.GetDestinationPorts())+len(m.GetNotDestinationPorts()) == 0
	return !empty && !slices.Contains(fields, false)
}

// field: some positive value holds (or none is given) and no negative one.
func field[T any](positive, negative []T, holds func(T) bool) bool {
	return (len(positive) == 0 || slices.ContainsFunc(positive, holds)) && !slices.ContainsFunc(negative, holds)
}

func stringMatches(s *security.StringMatch, v string) bool {
	switch m := s.GetMatchType().(type) {
	case *security.StringMatch_Exact:
		return v == m.Exact
	case *security.StringMatch_Prefix:
		return strings.HasPrefix(v, m.Prefix)
	case *security.StringMatch_Suffix:
		return strings.HasSuffix(v, m.Suffix)
	case *security.StringMatch_Presence:
		return v != ""
	}
	return false
}

func prefixContains(a *security.Address, ip netip.Addr) bool {
	addr, ok := netip.AddrFromSlice(a.GetAddress())
	if !ok {
		return false
	}
	p, err := addr.Unmap().Prefix(int(a.GetLength()))
	return err == nil && p.Contains(ip.Unmap())
}

// checkPolicy rejects a policy whose addresses the proxy cannot read: it
// would match differently from what its author meant.
func checkPolicy(p *security.Authorization) error {
	for _, g := range p.GetGroups() {
		for _, clause := range g.GetRules() {
			for _, m := range clause.GetMatches() {
				for _, lists := range [][]*security.Address{m.GetSourceIps(), m.GetNotSourceIps(), m.GetDestinationIps(), m.GetNotDestinationIps()} {
					for _, a := range lists {
						addr, ok := netip.AddrFromSlice(a.GetAddress())
						if !ok || int(a.GetLength()) > addr.Unmap().BitLen() {
							return fmt.Errorf("%w: policy %s/%s: address %x/%d", ErrBadResource, p.GetNamespace(), p.GetName(), a.GetAddress(), a.GetLength())
						}
					}
				}
				for _, ports := range [][]uint32{m.GetDestinationPorts(), m.GetNotDestinationPorts()} {
					for _, port := range ports {
						if port > 65535 {
							return fmt.Errorf("%w: policy %s/%s: port %d", ErrBadResource, p.GetNamespace(), p.GetName(), port)
						}
					}
				}
			}
		}
	}
	return nil
}
