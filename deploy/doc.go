// SPDX-License-Identifier: Apache-2.0

// Package deploy holds what an operator installs to run mtlsbridge on a
// Cilium cluster (README.md, "Install on a Cilium cluster"): for each mode
// (l2/, inpod/) Helm values for Cilium's own chart and the mTLS agent's
// DaemonSet (the reference agent, or a stock ztunnel); Kubernetes manifests
// both modes apply (kubernetes/: RBAC, the CNI configuration, the admission
// policy, the signer); and the CA Secret script. Its tests render Cilium's
// real chart with these values through Helm's Go SDK, apply the result to a
// real kube-apiserver, and run the agent with exactly the permissions
// shipped.
package deploy
