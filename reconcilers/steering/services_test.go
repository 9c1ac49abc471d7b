// SPDX-License-Identifier: Apache-2.0

package steering_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/mtlsbridge/mtlsbridge/api"
	"github.com/mtlsbridge/mtlsbridge/api/client"
	"github.com/mtlsbridge/mtlsbridge/internal/agenttest"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/steering"
)

// Cilium's effective configuration, one file per key as its agent reads
// it: Services are translated in pods' namespaces with kube-proxy
// replacement or bpf-lb-sock, unless bpf-lb-sock-hostns-only.
func TestServicesAtSocket(t *testing.T) {
	for _, c := range []struct {
		name   string
		config map[string]string
		want   string // "" for no error
	}{
		{"kube-proxy replacement", map[string]string{"kube-proxy-replacement": "true"}, ""},
		{"kube-proxy replacement, bpf-lb-sock false", map[string]string{"kube-proxy-replacement": "true", "bpf-lb-sock": "false"}, ""},
		{"socket LB alone", map[string]string{"kube-proxy-replacement": "false", "bpf-lb-sock": "true\n"}, ""},
		{"defaults", map[string]string{}, "socket LB is off"},
		{"kube-proxy", map[string]string{"kube-proxy-replacement": "false", "bpf-lb-sock": "false"}, "socket LB is off"},
		{"host namespace only", map[string]string{"kube-proxy-replacement": "true", "bpf-lb-sock-hostns-only": "true"}, "host namespace only"},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := steering.ServicesAtSocket(ciliumConfig(t, c.config))
			switch {
			case c.want == "" && err != nil:
				t.Errorf("%v, want no error", err)
			case c.want != "" && (!errors.Is(err, steering.ErrServicesUnsteered) || !strings.Contains(err.Error(), c.want)):
				t.Errorf("%v, want %v saying %q", err, steering.ErrServicesUnsteered, c.want)
			}
		})
	}
	if err := steering.ServicesAtSocket(filepath.Join(t.TempDir(), "missing")); err == nil || errors.Is(err, steering.ErrServicesUnsteered) {
		t.Errorf("missing folder: %v, want an error naming the flag", err)
	}
}

// The whole agent: /healthz names the problem as a warning, and stays
// ready (the sidecar's readiness is its Cilium pod's).
func TestServicesWarning(t *testing.T) {
	config := ciliumConfig(t, map[string]string{"kube-proxy-replacement": "false"})
	a := agenttest.Start(t, t.TempDir(), nil, "--cilium-config-dir="+config)
	var h api.Health
	if err := client.New(a.StateDir).GetJSON(t.Context(), "/healthz", &h); err != nil {
		t.Fatal(err)
	}
	if w := h.Warnings["cilium-services"]; !strings.Contains(w, steering.ErrServicesUnsteered.Error()) || len(h.Failing) != 0 {
		t.Errorf("/healthz %+v: want the warning cilium-services, nothing failing", h)
	}
	if !strings.Contains(a.Logs.String(), "Cilium's configuration leaves Service traffic unprotected") {
		t.Error("the problem is not logged at start")
	}
}

// ciliumConfig is a folder of Cilium's effective configuration holding
// settings, one file per key.
func ciliumConfig(t *testing.T, settings map[string]string) string {
	t.Helper()
	dir := t.TempDir()
	for key, value := range settings {
		if err := os.WriteFile(filepath.Join(dir, key), []byte(value), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}
