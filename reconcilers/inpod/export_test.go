// SPDX-License-Identifier: Apache-2.0

package inpod

// NetlinkTargetForTests is the cell's target, for tests that read real
// namespaces.
func NetlinkTargetForTests() Target { return newNetlinkTarget() }

// PruneInterval is the reconciler's periodic prune interval.
const PruneInterval = pruneInterval
