// SPDX-License-Identifier: Apache-2.0

package kubetest

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
)

// AuditEvent is the part of an audit.k8s.io/v1 Event that tests read: who
// asked for what, and the answer.
type AuditEvent struct {
	Stage string `json:"stage"`
	Verb  string `json:"verb"`
	User  struct {
		Username string              `json:"username"`
		Extra    map[string][]string `json:"extra"`
	} `json:"user"`
	ObjectRef *struct {
		Resource    string `json:"resource"`
		Subresource string `json:"subresource"`
		Namespace   string `json:"namespace"`
		Name        string `json:"name"`
		APIGroup    string `json:"apiGroup"`
	} `json:"objectRef"`
	ResponseStatus *struct {
		Code   int    `json:"code"`
		Reason string `json:"reason"`
	} `json:"responseStatus"`
	RequestURI string `json:"requestURI"`
}

// ReadAuditLog parses an audit log written by a server started with
// Options.AuditPolicy.
func ReadAuditLog(path string) ([]AuditEvent, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var events []AuditEvent
	scanner := bufio.NewScanner(f)
	// An event carries no request or response body at level Metadata, but
	// long URIs and user extras still exceed bufio's 64 KiB default now and
	// then.
	scanner.Buffer(make([]byte, 0, 1<<20), 16<<20)
	for line := 1; scanner.Scan(); line++ {
		var e AuditEvent
		if err := json.Unmarshal(scanner.Bytes(), &e); err != nil {
			return nil, fmt.Errorf("%s:%d: %w", path, line, err)
		}
		events = append(events, e)
	}
	return events, scanner.Err()
}
