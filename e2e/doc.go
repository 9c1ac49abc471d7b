// SPDX-License-Identifier: Apache-2.0

// Package e2e holds the end-to-end tests of a node: the mtlsbridge agent
// and mtlsbridge-cni as built binaries, the reference CNI plugins ptp and
// static in front of mtlsbridge-cni as Cilium is, a container runtime
// played through libcni, network namespaces for the nodes and pods, and a
// packet capture on the node's uplink. They need root, and skip without it
// (or fail with MTLSBRIDGE_REQUIRE_PRIVILEGED=1).
package e2e
