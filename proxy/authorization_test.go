// SPDX-License-Identifier: Apache-2.0

package proxy_test

import (
	"net/netip"
	"testing"

	"istio.io/istio/pkg/workloadapi/security"

	"github.com/mtlsbridge/mtlsbridge/proxy"
)

// TestAuthorize: ztunnel's semantics on a connection from web to api's
// port 8080. Empty set: any mesh identity. DENY first; with ALLOW
// policies one must match; dry-run never decides; an empty match
// matches nothing; fields AND, values OR, not_ values exclude.
func TestAuthorize(t *testing.T) {
	conn := proxy.Connection{
		Source:         netip.MustParseAddrPort("10.0.1.10:40000"),
		Destination:    netip.MustParseAddrPort("10.0.2.10:8080"),
		SourceIdentity: "spiffe://cluster.local/ns/app/sa/web",
	}
	exact := func(s string) *security.StringMatch {
		return &security.StringMatch{MatchType: &security.StringMatch_Exact{Exact: s}}
	}
	prefix := func(s string) *security.StringMatch {
		return &security.StringMatch{MatchType: &security.StringMatch_Prefix{Prefix: s}}
	}
	policy := func(name string, action security.Action, matches ...*security.Match) *security.Authorization {
		return &security.Authorization{Name: name, Namespace: "app", Action: action,
			Groups: []*security.Group{{Rules: []*security.Rules{{Matches: matches}}}}}
	}
	cidr := func(p string) *security.Address {
		pp := netip.MustParsePrefix(p)
		return &security.Address{Address: pp.Addr().AsSlice(), Length: uint32(pp.Bits())}
	}
	allow, deny := security.Action_ALLOW, security.Action_DENY
	for _, tc := range []struct {
		name     string
		policies []*security.Authorization
		want     bool
	}{
		{"no policy: any mesh identity", nil, true},
		{"allow by principal", []*security.Authorization{policy("a", allow, &security.Match{Principals: []*security.StringMatch{exact("cluster.local/ns/app/sa/web")}})}, true},
		{"allow for someone else", []*security.Authorization{policy("a", allow, &security.Match{Principals: []*security.StringMatch{exact("cluster.local/ns/app/sa/db")}})}, false},
		{"allow by namespace prefix and port", []*security.Authorization{policy("a", allow, &security.Match{
			Namespaces: []*security.StringMatch{prefix("ap")}, DestinationPorts: []uint32{80, 8080}})}, true},
		{"allow by namespace, wrong port", []*security.Authorization{policy("a", allow, &security.Match{
			Namespaces: []*security.StringMatch{exact("app")}, DestinationPorts: []uint32{80}})}, false},
		{"allow by source range", []*security.Authorization{policy("a", allow, &security.Match{SourceIps: []*security.Address{cidr("10.0.1.0/24")}})}, true},
		{"allow except the source range", []*security.Authorization{policy("a", allow, &security.Match{
			Namespaces: []*security.StringMatch{exact("app")}, NotSourceIps: []*security.Address{cidr("10.0.1.0/24")}})}, false},
		{"service account", []*security.Authorization{policy("a", allow, &security.Match{ServiceAccounts: []*security.ServiceAccountMatch{{Namespace: "app", ServiceAccount: "web"}}})}, true},
		{"empty match matches nothing", []*security.Authorization{policy("a", allow, &security.Match{})}, false},
		{"deny wins over allow", []*security.Authorization{
			policy("a", allow, &security.Match{Namespaces: []*security.StringMatch{exact("app")}}),
			policy("d", deny, &security.Match{DestinationPorts: []uint32{8080}})}, false},
		{"deny not matching", []*security.Authorization{policy("d", deny, &security.Match{DestinationPorts: []uint32{9090}})}, true},
		{"dry-run deny does not decide", []*security.Authorization{{Name: "d", Namespace: "app", Action: deny, DryRun: true,
			Groups: []*security.Group{{Rules: []*security.Rules{{Matches: []*security.Match{{DestinationPorts: []uint32{8080}}}}}}}}}, true},
		{"clauses AND", []*security.Authorization{{Name: "a", Namespace: "app", Action: allow, Groups: []*security.Group{{Rules: []*security.Rules{
			{Matches: []*security.Match{{Namespaces: []*security.StringMatch{exact("app")}}}},
			{Matches: []*security.Match{{DestinationPorts: []uint32{9090}}}},
		}}}}}, false},
		{"groups OR", []*security.Authorization{{Name: "a", Namespace: "app", Action: allow, Groups: []*security.Group{
			{Rules: []*security.Rules{{Matches: []*security.Match{{DestinationPorts: []uint32{9090}}}}}},
			{Rules: []*security.Rules{{Matches: []*security.Match{{DestinationPorts: []uint32{8080}}}}}},
		}}}, true},
	} {
		if got := proxy.Authorize(tc.policies, conn); got.Allowed != tc.want {
			t.Errorf("%s: allowed=%v (%+v), want %v", tc.name, got.Allowed, got, tc.want)
		}
	}
}

// TestPoliciesApply: GLOBAL everywhere, NAMESPACE in its namespace,
// WORKLOAD_SELECTOR only where the workload names it.
func TestPoliciesApply(t *testing.T) {
	w := &proxy.Workload{Namespace: "app", Policies: []string{"app/sel"}}
	for _, tc := range []struct {
		p    *security.Authorization
		want bool
	}{
		{&security.Authorization{Name: "g", Namespace: "istio-system", Scope: security.Scope_GLOBAL}, true},
		{&security.Authorization{Name: "n", Namespace: "app", Scope: security.Scope_NAMESPACE}, true},
		{&security.Authorization{Name: "o", Namespace: "other", Scope: security.Scope_NAMESPACE}, false},
		{&security.Authorization{Name: "sel", Namespace: "app", Scope: security.Scope_WORKLOAD_SELECTOR}, true},
		{&security.Authorization{Name: "unsel", Namespace: "app", Scope: security.Scope_WORKLOAD_SELECTOR}, false},
	} {
		s := proxy.NewState("node-a")
		proxy.PutPolicyForTest(s, tc.p.Namespace+"/"+tc.p.Name, tc.p)
		if got := len(s.Policies(w)) == 1; got != tc.want {
			t.Errorf("%s/%s applies: %v, want %v", tc.p.Namespace, tc.p.Name, got, tc.want)
		}
	}
}
