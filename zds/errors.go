// SPDX-License-Identifier: Apache-2.0

package zds

import "errors"

var (
	// ErrProtocol: the peer broke the protocol in a way ztunnel treats as
	// fatal (it shuts down): an add without workload_info, keep after
	// snapshot_sent, a second snapshot_sent, or (for the server) a
	// message out of turn. The wrapped error says which.
	ErrProtocol = errors.New("zds protocol error")
	// ErrMessage: a datagram that is not a valid message: truncated, too
	// large, undecodable, without payload, with the wrong number of
	// descriptors. ztunnel nacks it and drops the connection.
	ErrMessage = errors.New("zds: bad message")
	// ErrNotNetns: the descriptor of an add is not a network namespace.
	ErrNotNetns = errors.New("not a network namespace")
	// ErrTimeout: the peer did not answer within the deadline; the
	// lock-step is lost and the connection must go.
	ErrTimeout = errors.New("zds: no answer in time")
)
