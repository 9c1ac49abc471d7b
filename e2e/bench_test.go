// SPDX-License-Identifier: Apache-2.0

package e2e_test

import (
	"context"
	"testing"
	"time"
)

// BenchmarkPodStart is the time of one CNI ADD through the chain (ptp with
// static IPAM, then mtlsbridge-cni) with the agent running: for a pod not
// enrolled, what the plugin's question costs; for an enrolled pod, also
// the wait until its redirect is in the kernel. The sandbox is torn down
// (DEL) between iterations, outside the timing. Needs root.
func BenchmarkPodStart(b *testing.B) {
	n := newNode(b)
	n.start()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	for _, bc := range []struct {
		name     string
		enrolled bool
	}{{"not-enrolled", false}, {"enrolled", true}} {
		b.Run(bc.name, func(b *testing.B) {
			p := n.newPod("bench-"+bc.name, bc.enrolled)
			// The first start waits for the agent to be up and the pod
			// to be in its tables; it is not measured.
			if _, _, err := n.startSandbox(ctx, p); err != nil {
				b.Fatal(err)
			}
			n.writePod(p, true)
			must(b, n.runtime.Del(ctx, p.sb))
			for b.Loop() {
				p.sb.ContainerID = newContainerID(p)
				if _, err := n.runtime.Add(ctx, p.sb); err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				must(b, n.runtime.Del(ctx, p.sb))
				b.StartTimer()
			}
		})
	}
}
