// SPDX-License-Identifier: Apache-2.0

package redirect

import "errors"

var (
	// ErrDatapathUnavailable is the status of every row when the BPF
	// objects could not be loaded (not root, no bpffs, an incompatible
	// pinned map); the wrapped error says why.
	ErrDatapathUnavailable = errors.New("BPF datapath unavailable")
	// ErrDisabled is the datapath's state with --enable-redirect=false.
	ErrDisabled = errors.New("redirection disabled (--enable-redirect=false)")
	// ErrInactive is the datapath's state in another --redirect-mode: it
	// loads nothing and writes nothing.
	ErrInactive = errors.New("l2 datapath inactive (--redirect-mode is not l2)")
	// ErrNoInterface: no host-side veth has the pod's address on its peer
	// (the CNI has not finished, or the pod is not behind a veth).
	ErrNoInterface = errors.New("no interface found for the pod")
	// ErrAmbiguousInterface: several veths have one of the pod's addresses
	// on their peers (a pod with NET_ADMIN took another's address).
	ErrAmbiguousInterface = errors.New("several interfaces hold the pod's address")
	// ErrSandboxRunning: no running pod of the API claims an enrolled
	// address any more, but the interface it was steered on still holds it.
	ErrSandboxRunning = errors.New("sandbox still running")
	// ErrNoAgent: no pod of this node carries cilium.io/redir-type=proxy,
	// or none has an interface yet.
	ErrNoAgent = errors.New("no mTLS agent pod on this node")
	// ErrNoDevice: a device named in --devices does not exist.
	ErrNoDevice = errors.New("device not found")
)
