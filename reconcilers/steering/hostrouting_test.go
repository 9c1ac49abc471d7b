// SPDX-License-Identifier: Apache-2.0

package steering_test

import (
	"errors"
	"path/filepath"
	"testing"

	"github.com/mtlsbridge/mtlsbridge/reconcilers/steering"
)

// Cilium v1.20 falls back to the legacy host routing by itself without
// kube-proxy replacement or with iptables masquerading
// (pkg/kpr/initializer): only the BPF routing's settings are refused.
func TestHostLegacyRouting(t *testing.T) {
	bpfRouting := map[string]string{"kube-proxy-replacement": "true", "enable-bpf-masquerade": "true", "enable-host-legacy-routing": "false"}
	with := func(k, v string) map[string]string {
		c := map[string]string{k: v}
		for key, val := range bpfRouting {
			if key != k {
				c[key] = val
			}
		}
		return c
	}
	for _, c := range []struct {
		name   string
		config map[string]string
		bpf    bool
	}{
		{"BPF host routing", bpfRouting, true},
		{"BPF host routing, no masquerading", map[string]string{"kube-proxy-replacement": "true", "enable-ipv4-masquerade": "false", "enable-ipv6-masquerade": "false"}, true},
		// As Helm writes an IPv4 cluster without masquerading: IPv6's
		// masquerading counts only where IPv6 is on.
		{"BPF host routing, IPv4 without masquerading", map[string]string{"kube-proxy-replacement": "true", "enable-ipv4-masquerade": "false",
			"enable-ipv6": "false", "enable-ipv6-masquerade": "true"}, true},
		{"legacy routing set as Cilium parses it", with("enable-host-legacy-routing", "True"), false},
		{"legacy routing set, as a file ends", with("enable-host-legacy-routing", "true\n"), false},
		{"without kube-proxy replacement", with("kube-proxy-replacement", "false"), false},
		{"iptables masquerading", with("enable-bpf-masquerade", "false"), false},
		{"Cilium's defaults", map[string]string{}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			if err := steering.HostLegacyRouting(ciliumConfig(t, c.config)); errors.Is(err, steering.ErrBPFHostRouting) != c.bpf {
				t.Errorf("%v, want BPF host routing refused: %v", err, c.bpf)
			}
		})
	}
	if err := steering.HostLegacyRouting(filepath.Join(t.TempDir(), "missing")); err == nil || errors.Is(err, steering.ErrBPFHostRouting) {
		t.Errorf("missing folder: %v, want an error naming the flag", err)
	}
}
