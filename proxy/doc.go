// SPDX-License-Identifier: Apache-2.0

// Package proxy is mtlsbridge's reference mTLS agent for CFP-32759's L2
// mode (command mtlsbridge-proxy): the agent a Cilium operator can run to
// try mtlsbridge, and the one every other agent is measured against.
//
// It is configured exactly as ztunnel is (Config, ConfigFromEnv), so the
// node agent cannot tell them apart:
//
//   - XDS follows the node agent's delta xDS (Address and Authorization,
//     wildcard) into State: workloads by address and uid, policies;
//   - Certificates asks the node agent's CA for one certificate per
//     identity of this node's workloads, on their behalf;
//   - the capture (InstallCapture: nftables TPROXY through netlink) hands
//     the pods' redirected TCP to two loopback listeners, keeping the
//     original destination;
//   - outbound (15001): HBONE (HTTP/2 CONNECT over TLS 1.3 mTLS to the
//     destination pod's port 15008) when the destination is an HBONE
//     workload of another node, plain TCP from the pod's own address
//     otherwise; never plain TCP for an HBONE destination;
//   - inbound (15008): mTLS with the destination workload's certificate, a
//     client certificate of the trust domain required, Authorization
//     applied, then plain TCP to the pod from the source pod's address.
//
// See README.md beside this file for the contract, the security
// properties and how the e2e testbed proves them.
package proxy
