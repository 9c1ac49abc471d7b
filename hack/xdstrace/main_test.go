// SPDX-License-Identifier: Apache-2.0

package main

import (
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"testing"
	"time"

	"github.com/mtlsbridge/mtlsbridge/internal/gomodule"
)

// The breakdown of a real trace of BenchmarkXDSChangeLatency (1000
// workloads): the server's regions, the benchmark's marks and the server's
// TLS writes are found for most changes, in the order the steps assume.
func TestBreakdownOfRealTrace(t *testing.T) {
	if testing.Short() {
		t.Skip("runs the xDS benchmark")
	}
	root, err := gomodule.Root()
	if err != nil {
		t.Fatal(err)
	}
	tracePath := filepath.Join(t.TempDir(), "xds.trace")
	cmd := exec.Command(filepath.Join(runtime.GOROOT(), "bin", "go"), "test", "-run", "^$",
		"-bench", "BenchmarkXDSChangeLatency/mtlsbridge/1000$", "-benchtime", "1x", "-trace", tracePath, "./xds/")
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("benchmark: %v\n%s", err, out)
	}
	ev, err := read(tracePath)
	if err != nil {
		t.Fatal(err)
	}
	steps, n := breakdown(ev)
	// 200 changes; one whose marks the trace lost may be skipped.
	if n < 150 {
		t.Fatalf("%d changes followed through, want most of 200", n)
	}
	// The marks come in the order the breakdown reads them: no step is
	// negative at the median, none exceeds the total.
	median := func(s *step) time.Duration { return slices.Sorted(slices.Values(s.took))[n/2] }
	total := median(steps[len(steps)-1])
	for _, s := range steps {
		if m := median(s); m < 0 || m > total {
			t.Errorf("%s: median %v, total %v", s.name, m, total)
		}
	}
}
