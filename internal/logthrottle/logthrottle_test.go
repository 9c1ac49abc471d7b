// SPDX-License-Identifier: Apache-2.0

package logthrottle

import (
	"testing"
	"time"
)

func TestThrottle(t *testing.T) {
	th := New(50 * time.Millisecond)
	if _, ok := th.Allow("a"); !ok {
		t.Fatal("the first line of a key is not allowed")
	}
	for range 5 {
		if _, ok := th.Allow("a"); ok {
			t.Fatal("a repeated line within the interval is allowed")
		}
	}
	if _, ok := th.Allow("b"); !ok {
		t.Fatal("another key is throttled by the first")
	}
	time.Sleep(60 * time.Millisecond)
	if suppressed, ok := th.Allow("a"); !ok || suppressed != 5 {
		t.Fatalf("after the interval: allowed %v, suppressed %d, want true and 5", ok, suppressed)
	}
}
