// SPDX-License-Identifier: Apache-2.0

// Package deploy holds what an operator installs to run mtlsbridge on a
// Cilium cluster (README.md, "Install on a Cilium cluster"): Helm values for Cilium's own chart,
// Kubernetes manifests (RBAC, the CNI configuration, the admission policy,
// the reference mTLS agent) and the CA Secret script. Its tests render
// Cilium's real chart with these values through Helm's Go SDK, apply the
// result to a real kube-apiserver, and run the agent with exactly the
// permissions shipped.
package deploy
