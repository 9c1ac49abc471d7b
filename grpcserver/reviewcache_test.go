// SPDX-License-Identifier: Apache-2.0

package grpcserver

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	authnv1 "k8s.io/api/authentication/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

// The cache in front of TokenReview: repeated tokens are asked once per
// TTL, refusals are remembered briefly, API failures not at all, and a
// flood of distinct tokens cannot grow it beyond its bound. (The real
// TokenReview is tested against a kube-apiserver in agent/k8s_ca_test.go.)
func TestReviewCache(t *testing.T) {
	reviews := 0
	apiDown := false
	client := fake.NewClientset()
	client.PrependReactor("create", "tokenreviews", func(action k8stesting.Action) (bool, runtime.Object, error) {
		reviews++
		if apiDown {
			return true, nil, fmt.Errorf("connection refused")
		}
		tr := action.(k8stesting.CreateAction).GetObject().(*authnv1.TokenReview)
		audiences := tr.Spec.Audiences
		switch tr.Spec.Token {
		case "good":
		case "any-audience": // an authenticator that ignores audiences
			audiences = nil
		default:
			return true, &authnv1.TokenReview{Status: authnv1.TokenReviewStatus{Error: "invalid token"}}, nil
		}
		return true, &authnv1.TokenReview{Status: authnv1.TokenReviewStatus{
			Authenticated: true, Audiences: audiences,
			User: authnv1.UserInfo{Username: "system:serviceaccount:kube-system:ztunnel",
				Extra: map[string]authnv1.ExtraValue{extraPodName: {"ztunnel-a"}, extraNodeName: {"node-a"}}},
		}}, nil
	})
	now := time.Unix(1000, 0)
	c := newReviewCache(reviewer(client, []string{"istio-ca"}, newReviewBudget(budget{1e6, 1e6}, budget{1e6, 1e6}, func(netip.Addr) bool { return false })), 0)
	c.now = func() time.Time { return now }
	ctx := context.Background()

	want := Caller{Namespace: "kube-system", Pod: "ztunnel-a", ServiceAccount: "ztunnel", Node: "node-a"}
	for range 3 {
		if got, err := c.verify(ctx, "good"); err != nil || got != want {
			t.Fatalf("verify(good) = %+v, %v", got, err)
		}
	}
	if reviews != 1 {
		t.Fatalf("%d TokenReviews for one token within the TTL, want 1", reviews)
	}
	now = now.Add(reviewTTL)
	c.verify(ctx, "good")
	if reviews != 2 {
		t.Fatalf("%d TokenReviews after the TTL, want 2", reviews)
	}

	// Refusals: remembered for refusalTTL.
	for range 2 {
		if _, err := c.verify(ctx, "bad"); status.Code(err) != codes.Unauthenticated {
			t.Fatalf("verify(bad) = %v, want Unauthenticated", err)
		}
	}
	if reviews != 3 {
		t.Fatalf("%d TokenReviews, want the refusal asked once", reviews)
	}

	// Authenticated, but not for our audience: refused.
	if _, err := c.verify(ctx, "any-audience"); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("verify(any-audience) = %v, want Unauthenticated", err)
	}

	// An API server that does not answer teaches nothing: asked again.
	apiDown = true
	for range 2 {
		if _, err := c.verify(ctx, "other"); status.Code(err) != codes.Unavailable {
			t.Fatalf("verify with the API down = %v, want Unavailable", err)
		}
	}
	if reviews != 6 {
		t.Fatalf("%d TokenReviews, want failures not cached", reviews)
	}

	// A flood of distinct tokens stays bounded.
	apiDown = false
	for i := range 3 * minReviews {
		c.verify(ctx, fmt.Sprintf("flood-%d", i))
	}
	if n := len(c.entries); n > minReviews {
		t.Fatalf("%d cached reviews, want at most %d", n, minReviews)
	}
}

// The review budget: each peer has its own, strangers share the global
// one, and this node's mTLS agent pods do not spend it.
func TestReviewBudget(t *testing.T) {
	agent := netip.MustParseAddr("10.0.1.2")
	b := newReviewBudget(budget{0, 3}, budget{0, 2}, func(a netip.Addr) bool { return a == agent })
	from := func(ip string) context.Context {
		return peer.NewContext(context.Background(), &peer.Peer{Addr: &net.TCPAddr{IP: net.ParseIP(ip), Port: 4242}})
	}
	var allowed []string
	for _, ip := range []string{"192.0.2.1", "192.0.2.1", "192.0.2.1", "192.0.2.2", "192.0.2.3", "10.0.1.2", "10.0.1.2", "10.0.1.2"} {
		if err := b.allow(from(ip)); err == nil {
			allowed = append(allowed, ip)
		} else if status.Code(err) != codes.Unavailable {
			t.Fatalf("refusal %v, want Unavailable", err)
		}
	}
	// Peer 1 spends its 2; peer 2 takes the last global one; peer 3 finds
	// none; the agent has its own 2 and never touches the global budget.
	want := []string{"192.0.2.1", "192.0.2.1", "192.0.2.2", "10.0.1.2", "10.0.1.2"}
	if !slices.Equal(allowed, want) {
		t.Errorf("allowed %v, want %v", allowed, want)
	}
}
