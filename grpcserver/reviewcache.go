// SPDX-License-Identifier: Apache-2.0

package grpcserver

import (
	"context"
	"crypto/sha256"
	"errors"
	"sync"
	"time"
)

// reviewCache remembers what the API server said of a token for a short
// while, so that a client reconnecting in a loop (or hostile) does not turn
// every stream and certificate request into a TokenReview. Whether the
// token's pod is still this node's mTLS agent, with the UID the token is
// bound to, is checked against the tables on every call regardless, so a
// deleted pod loses access at once, even to a namesake.
type reviewCache struct {
	review func(ctx context.Context, token string) (Caller, error)
	now    func() time.Time

	mu      sync.Mutex
	entries map[[sha256.Size]byte]reviewEntry
	size    int
}

type reviewEntry struct {
	caller  Caller
	err     error
	expires time.Time
}

const (
	// reviewTTL bounds how long an accepted token is trusted without asking.
	reviewTTL = 30 * time.Second
	// refusalTTL is shorter: a token the API server just created may be
	// refused for a moment by a lagging replica.
	refusalTTL = 5 * time.Second
	// minReviews is the least bound of the cache (one entry per distinct
	// token); a listener of more connections (the signer's: one per node)
	// keeps twice as many.
	minReviews = 1024
)

func newReviewCache(review func(context.Context, string) (Caller, error), size int) *reviewCache {
	return &reviewCache{review: review, now: time.Now, entries: map[[sha256.Size]byte]reviewEntry{}, size: max(size, minReviews)}
}

func (c *reviewCache) verify(ctx context.Context, token string) (Caller, error) {
	key := sha256.Sum256([]byte(token)) // the token itself is never kept
	now := c.now()
	c.mu.Lock()
	e, ok := c.entries[key]
	c.mu.Unlock()
	if ok && now.Before(e.expires) {
		return e.caller, e.err
	}

	caller, err := c.review(ctx, token)
	ttl := reviewTTL
	if err != nil {
		var r *refusalError
		if !errors.As(err, &r) || r.reason == "tokenreview-failed" || r.reason == "tokenreview-budget" {
			return caller, err // the API server did not answer: nothing learnt
		}
		ttl = refusalTTL
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.entries) >= c.size {
		for k, old := range c.entries {
			if !now.Before(old.expires) {
				delete(c.entries, k)
			}
		}
		if len(c.entries) >= c.size {
			clear(c.entries) // all fresh: a flood of distinct tokens
		}
	}
	c.entries[key] = reviewEntry{caller: caller, err: err, expires: now.Add(ttl)}
	return caller, err
}
