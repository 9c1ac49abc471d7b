// SPDX-License-Identifier: Apache-2.0

package steering

import (
	"errors"
	"fmt"
	"strconv"
)

// ErrBPFHostRouting: Cilium routes pods' packets in BPF, past the node's
// netfilter. A pod's reply to an address the node's nftables SNATed its
// connection to (the in-pod mode's probe address) then leaves by the
// uplink instead of coming back through the node's connection tracking.
var ErrBPFHostRouting = errors.New("Cilium routes pods' packets past the node's netfilter (BPF host routing)")

// HostLegacyRouting reads Cilium's effective configuration (as
// ServicesAtSocket) and says why pods' packets would bypass the node's
// netfilter, or nil. Cilium v1.20 routes in BPF unless
// enable-host-legacy-routing is set, or it falls back to the legacy
// routing: without kube-proxy-replacement, or when it masquerades with
// iptables (a family's masquerading, on by default, counts where the
// family is enabled, and enable-bpf-masquerade replaces iptables).
func HostLegacyRouting(dir string) error {
	settings, err := CiliumSettings(dir, "enable-host-legacy-routing", "kube-proxy-replacement", "enable-bpf-masquerade",
		"enable-ipv4", "enable-ipv4-masquerade", "enable-ipv6", "enable-ipv6-masquerade")
	if err != nil {
		return err
	}
	// Cilium's defaults where a key has no file.
	defaults := []bool{false, false, false, true, true, true, true}
	on := make([]bool, len(settings))
	for i, v := range settings {
		on[i] = defaults[i]
		if b, err := strconv.ParseBool(v); err == nil {
			on[i] = b
		}
	}
	legacy, kpr, bpfMasquerade := on[0], on[1], on[2]
	masquerade := (on[3] && on[4]) || (on[5] && on[6])
	if legacy || !kpr || (masquerade && !bpfMasquerade) {
		return nil
	}
	return fmt.Errorf("%w: kube-proxy-replacement with BPF masquerading or none, enable-host-legacy-routing=%q (Helm bpf.hostLegacyRouting=true)",
		ErrBPFHostRouting, settings[0])
}
