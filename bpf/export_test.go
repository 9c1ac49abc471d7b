// SPDX-License-Identifier: Apache-2.0

package bpf

import "github.com/cilium/ebpf"

// ProxiedConnections is proxied_map, for tests that play its LRU evicting
// entries.
func (o *Objects) ProxiedConnections() *ebpf.Map { return o.objs.ProxiedMap }
