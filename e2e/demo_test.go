// SPDX-License-Identifier: Apache-2.0

package e2e_test

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

// DemoEnv set to 1 runs TestDemo (hack/demo-mtls.sh sets it), and
// DemoModeEnv chooses the node agents' --redirect-mode: l2 (the default)
// or inpod.
const (
	DemoEnv     = "MTLSBRIDGE_DEMO"
	DemoModeEnv = "MTLSBRIDGE_DEMO_MODE"
)

// TestDemo is make demo as root: the two-node testbed with a manifest
// folder, the flows of every check printed one per line (source,
// destination, enrolled ends, path with the identities each proxy saw,
// whether the payload crossed the underlay in clear), then each node
// agent's tables; everything is torn down at the end. It checks what it
// shows, as TestMTLS (l2) and TestInPodMTLS (inpod) do.
func TestDemo(t *testing.T) {
	if os.Getenv(DemoEnv) != "1" {
		t.Skipf("the demo runs from make demo (hack/demo-mtls.sh sets %s=1)", DemoEnv)
	}
	start := time.Now()
	out := os.Stdout
	shown := []string{"enrollments", "workloads"}
	mode := os.Getenv(DemoModeEnv)
	var b *bed
	switch mode {
	case "", "l2":
		fmt.Fprintln(out, "Two nodes (network namespaces joined by an underlay), each with the built node agent (BPF datapath,")
		fmt.Fprintln(out, "xDS, CA) and the built mtlsbridge-proxy in its own pod; pods start through the CNI chain.")
		b = newBed(t, newFolderCluster(t))
	case "inpod":
		fmt.Fprintln(out, "Two nodes (network namespaces joined by an underlay), each with the built node agent in the in-pod")
		fmt.Fprintln(out, "mode (the redirection written in each enrolled pod, ZDS, xDS, CA) and the built mtlsbridge-proxy")
		fmt.Fprintln(out, "as ztunnel runs (its listeners in each enrolled pod); pods start through the CNI chain.")
		b = newBedWith(t, newFolderCluster(t), bedConfig{inPod: true})
		shown = append(shown, "inpod", "zds")
	default:
		t.Fatalf("%s=%s: want l2 or inpod", DemoModeEnv, mode)
	}
	fmt.Fprintf(out, "Testbed up in %s. Every request below sends 48 KiB carrying a marker; a capture on the underlay\n", time.Since(start).Round(time.Millisecond))
	fmt.Fprintln(out, "looks for the marker in every segment between the nodes. Pods a*: node-a, b*: node-b.")
	if mode == "inpod" {
		runInPodChecks(t, b, out)
	} else {
		runChecks(t, b, out)
	}
	for _, n := range b.nodes {
		for _, table := range shown {
			cmd := exec.Command(filepath.Join(b.bin, "mtlsbridge"), "db", "show", table, "--state-dir="+n.stateDir)
			got, err := cmd.CombinedOutput()
			fmt.Fprintf(out, "\n== %s: mtlsbridge db show %s\n%s", n.name, table, got)
			if err != nil {
				t.Errorf("db show %s on %s: %v", table, n.name, err)
			}
		}
	}
	fmt.Fprintf(out, "\nDemo done in %s; tearing the testbed down.\n", time.Since(start).Round(time.Millisecond))
}
