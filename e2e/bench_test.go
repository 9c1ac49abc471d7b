// SPDX-License-Identifier: Apache-2.0

package e2e_test

import (
	"context"
	"slices"
	"testing"
	"time"
)

// BenchmarkPodStart is the time of one CNI ADD through the chain (ptp with
// static IPAM, then mtlsbridge-cni) with the agent running: for a pod not
// enrolled, what the plugin's question costs; for an enrolled pod, also
// the wait until its redirect is in the kernel. Each iteration starts one
// pod of each kind, alternating, so that both see the same machine; it
// reports their medians and the median of the enrolled pod's extra time.
// The sandboxes are torn down (DEL) between starts, outside the timing.
// Needs root.
func BenchmarkPodStart(b *testing.B) {
	n := newNode(b)
	n.start()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	pods := []*pod{n.newPod("bench-not-enrolled", false), n.newPod("bench-enrolled", true)}
	for _, p := range pods {
		// The first start waits for the agent to be up and the pod to
		// be in its tables; it is not measured.
		if _, _, err := n.startSandbox(ctx, p); err != nil {
			b.Fatal(err)
		}
		n.writePod(p, true)
		must(b, n.runtime.Del(ctx, p.sb))
	}
	var took [2][]time.Duration
	var extra []time.Duration
	for b.Loop() {
		var this [2]time.Duration
		for i, p := range pods {
			p.sb.ContainerID = newContainerID(p)
			start := time.Now()
			if _, err := n.runtime.Add(ctx, p.sb); err != nil {
				b.Fatal(err)
			}
			this[i] = time.Since(start)
			b.StopTimer()
			must(b, n.runtime.Del(ctx, p.sb))
			b.StartTimer()
		}
		took[0], took[1] = append(took[0], this[0]), append(took[1], this[1])
		extra = append(extra, this[1]-this[0])
	}
	median := func(d []time.Duration) float64 {
		slices.Sort(d)
		return float64(d[len(d)/2].Microseconds()) / 1000
	}
	b.ReportMetric(median(took[0]), "not-enrolled-ms")
	b.ReportMetric(median(took[1]), "enrolled-ms")
	b.ReportMetric(median(extra), "extra-ms")
}
