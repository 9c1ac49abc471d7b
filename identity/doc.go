// SPDX-License-Identifier: Apache-2.0

// Package identity is the certificate authority of the node's mTLS agent:
// it signs SPIFFE identities (package spiffe) of enrolled pods on
// this node, for this node's mTLS agent only, through the
// IstioCertificateService API ztunnel speaks.
package identity
