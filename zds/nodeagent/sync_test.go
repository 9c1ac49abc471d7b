// SPDX-License-Identifier: Apache-2.0

package nodeagent

import (
	"testing"
	"time"
)

// An add due for retry whose row then loses its namespace (the sandbox's
// CNI DEL) is kept, and no retry is due any more: a retry time left in the
// past would wake the connection's loop again at once, for ever.
func TestUnsendableRowIsNotRetried(t *testing.T) {
	w := &Workload{Pod: "app/a", UID: "uid-a", Name: "a", Namespace: "app", Problem: "network namespace unknown"}
	c := &conn{sent: map[string]*sent{"uid-a": {fingerprint: "uid-a with its old namespace", state: StateFailed,
		retryAt: time.Now().Add(-time.Second), backoff: time.Second}}}
	next, err := (&Server{}).sync(c, []*Workload{w}, true)
	if err != nil {
		t.Fatal(err)
	}
	if !next.IsZero() {
		t.Errorf("a retry is due at %v for a row that cannot be sent", next)
	}
	if st := c.sent["uid-a"]; st == nil || st.state != StateKept {
		t.Errorf("the connection's entry of the pod: %+v, want kept (ztunnel may serve it)", st)
	}
}
