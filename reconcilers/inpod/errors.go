// SPDX-License-Identifier: Apache-2.0

package inpod

import "errors"

var (
	// ErrNodeNetns: the namespace named for a pod is the node's (or the
	// agent's); nothing is ever written there.
	ErrNodeNetns = errors.New("the node's network namespace, not a pod's")
	// ErrWrongNetns: the namespace named for a pod does not hold the
	// pod's addresses (a stale or wrong report).
	ErrWrongNetns = errors.New("network namespace of another pod")
	// ErrNoNetns: no CNI report names the pod's network namespace: it
	// started before mtlsbridge-cni was in the chain, or the report was
	// lost, and the search of --netns-dir has not found it (yet).
	ErrNoNetns = errors.New("network namespace unknown: no CNI report of the pod's sandbox, none found yet (see job search-unreported-netns)")
	// ErrNoUID: neither the API nor a CNI report gives the pod's UID,
	// which ZDS names it by.
	ErrNoUID = errors.New("pod UID unknown")
	// ErrNetnsUnchecked: the namespace to hand to ztunnel cannot be
	// checked against the pod's addresses yet (its rows are changing).
	ErrNetnsUnchecked = errors.New("network namespace not checked")
)
