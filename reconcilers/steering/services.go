// SPDX-License-Identifier: Apache-2.0

package steering

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"

	"github.com/cilium/hive/cell"

	"github.com/mtlsbridge/mtlsbridge/api"
)

// ErrServicesUnsteered: Cilium does not translate Service addresses at the
// socket in pods' namespaces. A connection of an enrolled pod to a
// ClusterIP or NodePort then reaches the mTLS agent (or passes by it) with
// the Service's address, which the agent is not told about over xDS: it
// forwards the connection in plaintext, and Cilium sends it to a backend,
// possibly on another node, in clear.
var ErrServicesUnsteered = errors.New("connections of enrolled pods to Service addresses are not protected")

// ServicesAtSocket reads Cilium's effective configuration (the folder
// Cilium's agent reads it from, one file per key) and says why Services
// would not be translated at the socket in pods' namespaces, or nil.
// Cilium v1.20 turns socket LB on with kube-proxy-replacement, or alone
// with bpf-lb-sock; bpf-lb-sock-hostns-only keeps it out of pods.
func ServicesAtSocket(dir string) error {
	settings, err := CiliumSettings(dir, "kube-proxy-replacement", "bpf-lb-sock", "bpf-lb-sock-hostns-only")
	if err != nil {
		return err
	}
	kpr, sock, hostnsOnly := settings[0], settings[1], settings[2]
	switch {
	case kpr != "true" && sock != "true":
		return fmt.Errorf("%w: Cilium's socket LB is off (kube-proxy-replacement=%q, bpf-lb-sock=%q; Helm kubeProxyReplacement or socketLB.enabled)",
			ErrServicesUnsteered, kpr, sock)
	case hostnsOnly == "true":
		return fmt.Errorf("%w: Cilium's socket LB serves the host namespace only (bpf-lb-sock-hostns-only; Helm socketLB.hostNamespaceOnly)",
			ErrServicesUnsteered)
	}
	return nil
}

// CiliumSettings reads keys of Cilium's effective configuration (the
// folder Cilium's agent reads it from, one file per key), spaces trimmed;
// a key without a file is "" (Cilium's default).
func CiliumSettings(dir string, keys ...string) ([]string, error) {
	if _, err := os.Stat(dir); err != nil {
		return nil, fmt.Errorf("--cilium-config-dir=%s: %w", dir, err)
	}
	values := make([]string, len(keys))
	var errs []error
	for i, key := range keys {
		b, err := os.ReadFile(filepath.Join(dir, key))
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
		values[i] = strings.TrimSpace(string(b))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("--cilium-config-dir=%s: %w", dir, err)
	}
	return values, nil
}

// checkServices makes the check a readiness warning, /healthz shows it,
// and logs it at start (--cilium-config-dir; nothing when empty). A
// warning, not a failure: the sidecar's readiness is its Cilium pod's.
func checkServices(cfg Config, log *slog.Logger, lc cell.Lifecycle) api.CheckOut {
	check := func() error { return ServicesAtSocket(cfg.CiliumConfigDir) }
	if cfg.CiliumConfigDir == "" {
		check = func() error { return nil }
	}
	lc.Append(cell.Hook{OnStart: func(cell.HookContext) error {
		if err := check(); err != nil {
			log.Error("Cilium's configuration leaves Service traffic unprotected", "error", err)
		}
		return nil
	}})
	return api.CheckOut{Check: api.Check{Name: "cilium-services", Warning: true, Err: check}}
}
