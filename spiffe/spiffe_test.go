// SPDX-License-Identifier: Apache-2.0

package spiffe

import "testing"

func TestParseID(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want ID
		err  bool
	}{
		{in: "spiffe://cluster.local/ns/app/sa/web", want: ID{TrustDomain: "cluster.local", Namespace: "app", ServiceAccount: "web"}},
		{in: "spiffe://td.example/identity/4242", want: ID{TrustDomain: "td.example", CiliumIdentity: 4242}},
		{in: "spiffe://cluster.local/identity/0", err: true},
		{in: "spiffe://cluster.local/identity/007", err: true},
		{in: "spiffe://cluster.local/identity/4294967296", err: true},
		{in: "spiffe://Cluster.local/ns/app/sa/web", err: true},
		{in: "spiffe://cluster.local:443/ns/app/sa/web", err: true},
		{in: "spiffe://user@cluster.local/ns/app/sa/web", err: true},
		{in: "spiffe://cluster.local/ns/app/sa/web?x=1", err: true},
		{in: "spiffe://cluster.local/ns/app/sa/web#f", err: true},
		{in: "spiffe://cluster.local/ns/../sa/web", err: true},
		{in: "spiffe://cluster.local/ns//sa/web", err: true},
		{in: "spiffe://cluster.local/ns/app/sa/web/", err: true},
		{in: "spiffe://cluster.local/ns/app/web", err: true},
		{in: "spiffe://cluster.local", err: true},
		{in: "https://cluster.local/ns/app/sa/web", err: true},
		{in: "", err: true},
	} {
		got, err := ParseID(tc.in)
		if (err != nil) != tc.err {
			t.Errorf("ParseID(%q) error = %v, want error %v", tc.in, err, tc.err)
			continue
		}
		if err == nil && (got != tc.want || got.String() != tc.in) {
			t.Errorf("ParseID(%q) = %+v (%s), want %+v", tc.in, got, got, tc.want)
		}
	}
}
