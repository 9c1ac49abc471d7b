// SPDX-License-Identifier: Apache-2.0

package proxy

import "errors"

var (
	// ErrBadWorkload: a Workload resource the proxy cannot use (no uid,
	// an address that is neither 4 nor 16 bytes, an identity that does not
	// parse). The resource is NACKed; the rest of its response applies.
	ErrBadWorkload = errors.New("unusable workload")
	// ErrBadResource: a resource that does not decode as its type.
	ErrBadResource = errors.New("undecodable resource")
	// ErrConfig: an environment variable is missing or makes no sense; the
	// wrapped error names it.
	ErrConfig = errors.New("bad configuration")

	// ErrNoCertificate: the proxy holds no certificate for the identity a
	// connection needs (not issued yet, or the CA refused it).
	ErrNoCertificate = errors.New("no certificate for the identity")
	// ErrPeerIdentity: the peer's certificate does not carry the identity
	// the connection must reach or come from.
	ErrPeerIdentity = errors.New("peer identity mismatch")
	// ErrPeerCertificate: the peer's certificate does not verify against
	// the trust bundle, or is not a workload certificate of the trust
	// domain (exactly one URI SAN).
	ErrPeerCertificate = errors.New("peer certificate refused")
	// ErrBadChain: the CA answered a chain the proxy must not use (leaf for
	// another identity or key, no root, does not verify).
	ErrBadChain = errors.New("certificate chain refused")

	// ErrUnknownSource: an outbound connection from an address that is not
	// a workload of this node.
	ErrUnknownSource = errors.New("source is not a local workload")
	// ErrLoop: a connection addressed to the proxy itself.
	ErrLoop = errors.New("destination is the proxy itself")
	// ErrDenied: an Authorization policy denies the connection.
	ErrDenied = errors.New("denied by authorization policy")
	// ErrBadRequest: an HBONE request that is not a CONNECT to a local
	// workload's address.
	ErrBadRequest = errors.New("bad HBONE request")
	// ErrTunnelRefused: the peer proxy answered the CONNECT with another
	// status than 200.
	ErrTunnelRefused = errors.New("HBONE tunnel refused")
	// ErrIdle ends a proxied connection that moved no byte either way for
	// the idle timeout.
	ErrIdle = errors.New("idle timeout")
	// ErrNotSynced: a connection came before the proxy held the node
	// agent's first answer of each type, and that did not come within
	// syncWait. Deciding on a partial view could send an enrolled
	// destination plain TCP, or skip a DENY policy.
	ErrNotSynced = errors.New("xDS not synced")
	// ErrOverloaded: the proxy holds its maximum of connections.
	ErrOverloaded = errors.New("too many connections")
)
