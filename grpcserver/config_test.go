// SPDX-License-Identifier: Apache-2.0

package grpcserver

import (
	"strings"
	"testing"
)

// An empty audience list (or an empty audience) would have TokenReview
// accept tokens meant for the API server: the agent refuses to start.
func TestTokenAudiencesRequired(t *testing.T) {
	for _, audiences := range [][]string{nil, {""}, {"istio-ca", ""}} {
		c := defaultConfig
		c.TokenAudiences = audiences
		if err := c.validate(); err == nil || !strings.Contains(err.Error(), "--token-audiences") {
			t.Errorf("audiences %q: %v, want an error naming --token-audiences", audiences, err)
		}
	}
	if err := defaultConfig.validate(); err != nil {
		t.Errorf("default config: %v", err)
	}
}
