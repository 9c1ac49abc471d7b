// SPDX-License-Identifier: Apache-2.0

package deploy_test

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"

	"github.com/mtlsbridge/mtlsbridge/reconcilers/inpod"
)

// TestInPodSidecar runs the sidecar switched to the in-pod mode as README's
// "Running a stock ztunnel with mtlsbridge" says: its flags, and the
// capabilities NET_ADMIN and SYS_ADMIN instead of the l2 mode's BPF and
// PERFMON. It finds the enrolled pod's namespace among the runtime's
// pinned ones (no CNI report: mtlsbridge was installed after it started),
// writes its redirection there, and with --probe-snat (Cilium's settings
// those of its legacy host routing) makes the node's own connections reach
// the pod past it, with no ztunnel anywhere; under Cilium's BPF host
// routing it SNATs nothing, and its readiness output says why. Without
// SYS_ADMIN it cannot enter the pod's namespace: its log and the pod's
// row say so.
func TestInPodSidecar(t *testing.T) {
	c := newCluster(t)
	netnsDir := t.TempDir()
	c.web.NS.Pin(t, filepath.Join(netnsDir, "web"))
	// Short: UNIX socket paths are limited to 108 bytes.
	zdsDir, err := os.MkdirTemp("", "mtlsb-zds-")
	must(t, err)
	t.Cleanup(func() { os.RemoveAll(zdsDir) })
	c.web.Serve(t, "web", 8080, false, c.web.IP4, c.web.IP6)
	ciliumConfig := func(settings map[string]string) string {
		dir := t.TempDir()
		for key, value := range settings {
			must(t, os.WriteFile(filepath.Join(dir, key), []byte(value), 0o644))
		}
		return dir
	}
	legacyRouting := ciliumConfig(map[string]string{"kube-proxy-replacement": "true", "enable-host-legacy-routing": "true"})
	bpfRouting := ciliumConfig(map[string]string{"kube-proxy-replacement": "true", "enable-bpf-masquerade": "true"})
	flags := func(ciliumConfig string) []string {
		return []string{"--redirect-mode=inpod", "--zds-socket=" + filepath.Join(zdsDir, "ztunnel.sock"),
			"--netns-dir=" + netnsDir, "--netns-search-min-age=0s", "--probe-snat",
			// The last of a flag given twice holds: Cilium's configuration here.
			"--cilium-config-dir=" + ciliumConfig}
	}
	caps := slices.DeleteFunc(capsOf(c.sidecar), func(cp string) bool { return cp == "BPF" || cp == "PERFMON" })
	if len(caps) != 1 {
		t.Fatalf("the sidecar adds %v; this test expects NET_ADMIN beside BPF and PERFMON", capsOf(c.sidecar))
	}

	t.Run("without SYS_ADMIN", func(t *testing.T) {
		c.reset(t)
		r := c.freshRun(t, caps, flags(legacyRouting)...)
		logSays(t, r, "Cannot redirect an enrolled pod", "app/web", "operation not permitted")
		shellSays(t, c, r, []string{"db/show", "inpod"}, "app/web", "network namespace unknown")
		r.stop()
	})

	t.Run("with SYS_ADMIN", func(t *testing.T) {
		c.reset(t)
		r := c.freshRun(t, append(slices.Clone(caps), "SYS_ADMIN"), flags(legacyRouting)...)
		shellSays(t, c, r, []string{"db/show", "inpod"}, "app/web", "/web", "Done")
		for i, probe := range []netip.Addr{inpod.ProbeSNAT4, inpod.ProbeSNAT6} {
			dst := netip.AddrPortFrom([]netip.Addr{c.web.IP4, c.web.IP6}[i], 8080)
			waitFor(t, r, "the node's connection to "+dst.String()+" from the probe address", func() error {
				got, err := c.node.Ask(dst)
				if err == nil && (got.Server != "web" || got.Remote.Addr() != probe) {
					err = fmt.Errorf("answered %v", got)
				}
				return err
			})
		}
		r.stop()
	})

	// Under Cilium's BPF host routing the pod's replies would leave by the
	// uplink: nothing is SNATed (the table written above goes), and the
	// readiness probe's output says why.
	t.Run("under BPF host routing", func(t *testing.T) {
		c.reset(t)
		r := c.freshRun(t, append(slices.Clone(caps), "SYS_ADMIN"), flags(bpfRouting)...)
		healthSays(t, c, r, `"probe-snat"`, "BPF host routing")
		dst := netip.AddrPortFrom(c.web.IP4, 8080)
		waitFor(t, r, "the node's connection to "+dst.String()+" redirected in the pod (refused: no ztunnel)", func() error {
			if got, err := c.node.Ask(dst); !errors.Is(err, syscall.ECONNREFUSED) {
				return fmt.Errorf("answered %v, %v", got, err)
			}
			return nil
		})
		r.stop()
	})
}
