// SPDX-License-Identifier: Apache-2.0

package steering

import (
	"errors"
	"fmt"
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
// iptables (IPv4 or IPv6 masquerading, on by default, without
// enable-bpf-masquerade).
func HostLegacyRouting(dir string) error {
	settings, err := CiliumSettings(dir, "enable-host-legacy-routing", "kube-proxy-replacement",
		"enable-ipv4-masquerade", "enable-ipv6-masquerade", "enable-bpf-masquerade")
	if err != nil {
		return err
	}
	legacy, kpr, masq4, masq6, bpfMasq := settings[0], settings[1], settings[2], settings[3], settings[4]
	iptablesMasquerade := (masq4 != "false" || masq6 != "false") && bpfMasq != "true"
	if legacy == "true" || kpr != "true" || iptablesMasquerade {
		return nil
	}
	return fmt.Errorf("%w: enable-host-legacy-routing=%q with kube-proxy-replacement and BPF masquerading (Helm bpf.hostLegacyRouting=true)",
		ErrBPFHostRouting, legacy)
}
