// SPDX-License-Identifier: Apache-2.0

// Package zds speaks ZDS, the protocol by which a node agent hands pods'
// network namespaces to ztunnel in its in-pod mode (istio.io/istio's
// pkg/zdsapi types, on a UNIX SOCK_SEQPACKET socket, one message per
// datagram, a namespace as an SCM_RIGHTS descriptor).
//
// Both ends are here:
//
//   - Conn: one connection, either side: messages of at most 1024 bytes,
//     truncation refused, at most one descriptor, strict lock-step (every
//     request waits for its Ack).
//   - package zds/nodeagent: the node agent's side (reconcilers/inpod runs
//     it), on statedb tables. Hello, then an add per pod with its namespace
//     (keep when the namespace is gone), snapshot_sent, then live add and
//     del; adds go to the newest connection, dels to all. Every pod's row
//     says what was sent, acknowledged or refused, on which connection.
//   - Client: ztunnel's side, written from the protocol, with ztunnel's
//     fatal cases (an add without workload_info, keep after snapshot_sent,
//     a second snapshot_sent): the reference mTLS agent (package proxy)
//     runs it, and the tests run the node agent's side against it.
//
// This package imports neither statedb nor Kubernetes: the mTLS agent
// links it.
package zds
