// SPDX-License-Identifier: Apache-2.0

package redirect_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/mtlsbridge/mtlsbridge/api"
	"github.com/mtlsbridge/mtlsbridge/api/client"
	"github.com/mtlsbridge/mtlsbridge/internal/agenttest"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/redirect"
)

// The whole agent: while Cilium verifies pods' source addresses (its
// default), /healthz warns (cilium-source-ip) until this node's mTLS agent
// pod is exempt, naming what is missing, and stays ready.
func TestSourceIPWarning(t *testing.T) {
	config, manifests := t.TempDir(), t.TempDir()
	agentPod := func(namespaceAnnotations, podAnnotations string) string {
		return `apiVersion: v1
kind: Namespace
metadata: {name: kube-system, annotations: {` + namespaceAnnotations + `}}
---
apiVersion: v1
kind: Pod
metadata: {name: ztunnel-a, namespace: kube-system, labels: {cilium.io/redir-type: proxy}, annotations: {` + podAnnotations + `}}
spec: {nodeName: node-a}
status: {phase: Running, podIPs: [{ip: 10.0.1.2}]}
`
	}
	write := func(name, content string) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(manifests, name), []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("cluster.yaml", agentPod("", ""))
	a := agenttest.Start(t, manifests, nil, "--cilium-config-dir="+config)
	// warningIs waits for the warning to say each of want, and none of
	// the strings of want that start with "!".
	warningIs := func(want ...string) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for {
			var h api.Health // fresh: decoding would merge into the last maps
			if err := client.New(a.StateDir).GetJSON(t.Context(), "/healthz", &h); err != nil {
				t.Fatal(err)
			}
			w := h.Warnings["cilium-source-ip"]
			matches := len(h.Failing) == 0 && (len(want) == 0) == (w == "")
			for _, s := range want {
				if absent, ok := strings.CutPrefix(s, "!"); ok {
					matches = matches && w != "" && !strings.Contains(w, absent)
				} else {
					matches = matches && strings.Contains(w, s)
				}
			}
			if matches {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("/healthz %+v: want the warning cilium-source-ip saying %q, nothing failing", h, want)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	warningIs(redirect.ErrSourceIPVerified.Error(), "kube-system/ztunnel-a",
		"namespace kube-system annotated config.cilium.io/delegate-source-ip-verification=true",
		"the pod annotated config.cilium.io/disable-source-ip-verification=true")

	// The pod asks, but its namespace does not delegate: Cilium ignores it.
	write("cluster.yaml", agentPod("", `config.cilium.io/disable-source-ip-verification: "true"`))
	warningIs("namespace kube-system annotated", "!the pod annotated")
	// Both, as Cilium reads them (spaces and any true of ParseBool).
	write("cluster.yaml", agentPod(`config.cilium.io/delegate-source-ip-verification: " True "`, `config.cilium.io/disable-source-ip-verification: "1"`))
	warningIs()

	// Cilium verifies nothing (any false of ParseBool): no warning,
	// whatever the pod; verifying explicitly, it warns again.
	write("cluster.yaml", agentPod("", ""))
	warningIs("the pod annotated")
	setting := func(v string) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(config, "enable-source-ip-verification"), []byte(v), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	setting("False\n")
	warningIs()
	setting("true")
	warningIs("the pod annotated")
}
