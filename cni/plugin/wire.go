// SPDX-License-Identifier: Apache-2.0

package plugin

import (
	"net/netip"
	"time"
)

// PluginType is the "type" of the plugin's entry in a conflist and the
// name of its binary.
const PluginType = "mtlsbridge-cni"

// Fail policies: what ADD does when the agent cannot be reached.
const (
	FailClosed = "closed" // fail the ADD; the kubelet retries
	FailOpen   = "open"   // let the pod start unprotected, logged on stderr
)

// Redirect states in an Answer.
const (
	RedirectReady     = "ready"      // the pod's redirection is in place
	RedirectPending   = "pending"    // enrolled, not in place (yet)
	RedirectNotNeeded = "not-needed" // not enrolled
)

// Routes of the agent's local API (api.sock).
const (
	// PodPathPrefix + "NAMESPACE/NAME": POST a Request, get an Answer.
	// Query parameter "wait" (a duration, at most MaxWait) holds the answer
	// until it is final (ready, not-needed) or the wait is over.
	PodPathPrefix = "/v1/cni/pods/"
	// ContainerPathPrefix + "CONTAINER_ID": DELETE forgets a container.
	ContainerPathPrefix = "/v1/cni/containers/"
	// MaxWait bounds one long poll.
	MaxWait = 10 * time.Second
)

// Request tells the agent about a container being added to a pod.
type Request struct {
	ContainerID string `json:"containerID"`
	// PodUID tells a pod from an earlier one of the same name.
	PodUID string `json:"podUID,omitempty"`
	Netns  string `json:"netns,omitempty"`
	IfName string `json:"ifName,omitempty"`
	// IPs are the pod's addresses from prevResult: the API does not have
	// them yet at ADD time.
	IPs []netip.Addr `json:"ips,omitempty"`
}

// Answer is the agent's decision for the pod.
type Answer struct {
	// Known is false while the agent has not seen the pod in the API, or
	// has not listed what decides on it yet (Detail says so).
	Known    bool   `json:"known"`
	Enrolled bool   `json:"enrolled"`
	Reason   string `json:"reason,omitempty"`
	// Redirect is one of RedirectReady, RedirectPending, RedirectNotNeeded.
	Redirect string `json:"redirect,omitempty"`
	// Detail explains a pending redirect.
	Detail string `json:"detail,omitempty"`
}

// Final reports whether the pod may start: not enrolled, or redirected.
func (a Answer) Final() bool {
	return a.Known && (a.Redirect == RedirectReady || a.Redirect == RedirectNotNeeded)
}
