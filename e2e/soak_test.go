// SPDX-License-Identifier: Apache-2.0

package e2e_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mtlsbridge/mtlsbridge/internal/cnitest"
)

// soakRestarts is the least number of SIGKILL restarts of each agent a
// soak makes, however short it is asked to be; soakAPIRestarts of the
// API server (each takes seconds).
const (
	soakRestarts    = 50
	soakAPIRestarts = 10
)

// soakDuration is how long each part of TestSoak runs: MTLSBRIDGE_SOAK
// (a Go duration, `make soak SOAK=30m`); TestSoak is skipped without it.
func soakDuration(t *testing.T) time.Duration {
	s := os.Getenv("MTLSBRIDGE_SOAK")
	if s == "" {
		t.Skip("soak test: set MTLSBRIDGE_SOAK to a duration (make soak)")
	}
	d, err := time.ParseDuration(s)
	if err != nil || d <= 0 {
		t.Fatalf("MTLSBRIDGE_SOAK=%q: want a positive duration", s)
	}
	return d
}

// TestSoak is TestNeverLeak's proof for as long as asked: the node agent
// killed with SIGKILL and restarted at least soakRestarts times while pods
// start and go for the whole duration, and then the mTLS agent (the
// reference proxy, on the two-node testbed) killed with SIGKILL and
// restarted as many times, its node agent too every fifth time, while
// enrolled pods talk across nodes, and then the API server of a two-node
// testbed in Kubernetes mode killed and restarted, the node agent too
// while it is down every other time. No segment from an enrolled pod's
// address may cross the wire in clear.
func TestSoak(t *testing.T) {
	d := soakDuration(t)
	t.Run("node-agent", func(t *testing.T) { soakNodeAgent(t, d) })
	t.Run("mtls-agent", func(t *testing.T) { soakMTLSAgent(t, d) })
	t.Run("api-server", func(t *testing.T) { soakAPIServer(t, d) })
}

// soakNodeAgent: TestNeverLeak's node, its pods cycling through new
// sandboxes (and new pod objects) until the end; each pod keeps its
// addresses, so that a captured segment still names its pod.
func soakNodeAgent(t *testing.T, d time.Duration) {
	n := newNode(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*d+10*time.Minute)
	defer cancel()
	const slots = 120 // pods, within maxAddrs
	pool := make(chan *pod, slots)
	for i := range slots {
		pool <- n.newPod(fmt.Sprintf("s%d", i), i%3 != 2) // two of three enrolled
	}
	var (
		tr               traffic
		starts, failures atomic.Int64
		wg               sync.WaitGroup
		done             = make(chan struct{})
	)
	for range concurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				var p *pod
				select {
				case <-done:
					return
				case p = <-pool:
				}
				// A new pod of the same name: new UID, new sandbox.
				sb := cnitest.NewSandbox(p.ns, "app", p.name)
				sb.Addrs, sb.Gateways = p.sb.Addrs, p.sb.Gateways
				p.sb, p.uid = sb, sb.UID
				n.writePod(p, false)
				hostIf, failed, err := n.startSandbox(ctx, p)
				failures.Add(int64(failed))
				if err != nil {
					t.Error(err)
					return
				}
				starts.Add(1)
				time.Sleep(time.Duration(rand.IntN(300)) * time.Millisecond)
				n.writePod(p, true)
				stop := make(chan struct{})
				ran := make(chan struct{})
				go func() { n.run(p, stop, &tr); close(ran) }()
				time.Sleep(time.Duration(300+rand.IntN(1200)) * time.Millisecond)
				close(stop)
				<-ran
				if err := n.runtime.Del(context.Background(), p.sb); err != nil {
					t.Errorf("DEL of %s (%s): %v", p.name, hostIf, err)
				}
				n.deletePod(p)
				pool <- p
			}
		}()
	}

	end := time.Now().Add(d)
	restarts := n.restartUntil(t, func(restarts int) bool {
		return (restarts >= soakRestarts && time.Now().After(end)) || ctx.Err() != nil
	})
	close(done)
	wg.Wait()

	leaked, plain := n.checkNoLeak(t, &tr)
	t.Logf("soak %s: %d node agent restarts (SIGKILL), %d pod starts (%d failed ADDs retried), "+
		"%d connections from pods (%d answered by the mTLS agent, %d directly, %d failed), "+
		"%d segments captured on the uplink (%d with payload from pods not enrolled, %d from enrolled pods)",
		d, restarts, starts.Load(), failures.Load(), tr.sent.Load(), tr.agent.Load(), tr.direct.Load(), tr.failed.Load(),
		len(n.capture.Segments()), plain, len(leaked))
	if restarts < soakRestarts {
		t.Errorf("%d restarts, want at least %d", restarts, soakRestarts)
	}
}

// soakMTLSAgent: on the two-node testbed, node-a's proxy is killed
// (SIGKILL) and restarted, and every fifth time node-a's agent too. While
// the proxy is down, a1's connections to b1 must fail, never go in clear;
// once it is back, they are mTLS.
func soakMTLSAgent(t *testing.T, d time.Duration) {
	b := newBed(t, newFolderCluster(t))
	na := b.nodes[0]
	a1, b1 := na.addPod("a1", "app", true, false), b.nodes[1].addPod("b1", "app", true, false)
	b.knows(na, a1, b1, true)
	var flows, failedDown, clear int
	check := func(f *flow, down bool) {
		flows++
		if plain := f.plainSegments(); len(plain) > 0 || f.visible {
			clear++
			t.Errorf("a1 -> b1 (proxy down %v): in clear on the underlay: visible %v, %v", down, f.visible, plain)
		}
		switch {
		case down && f.err != nil:
			failedDown++
		case down:
			t.Errorf("a1 -> b1 answered with node-a's proxy down: %v", f.reply)
		default:
			expectMTLS(t, f)
		}
	}
	restarts, agentRestarts := 0, 0
	end := time.Now().Add(d)
	for (restarts < soakRestarts || time.Now().Before(end)) && !t.Failed() {
		v6 := restarts%2 == 1
		na.killProxy()
		check(b.run(a1, b1, v6), true)
		if restarts%5 == 4 {
			na.killAgent()
			na.startAgent()
			na.waitAgent()
			agentRestarts++
		}
		na.startProxy()
		na.waitProxyReady()
		b.knows(na, a1, b1, true)
		check(b.run(a1, b1, v6), false)
		restarts++
	}
	t.Logf("soak %s: %d mTLS agent restarts (SIGKILL), %d node agent restarts with it, %d flows a1 -> b1 "+
		"(%d refused while the proxy was down), %d segments on the underlay, %d flows in clear",
		d, restarts, agentRestarts, flows, failedDown, len(b.underlay.Segments()), clear)
}

// soakAPIServer: on the two-node testbed in Kubernetes mode, the API server
// is killed and started again; while it is down, a1 -> b1 must stay mTLS
// (nothing needs the API server once the pods are known), and every other
// time node-a's agent is killed (SIGKILL) and started again without an API
// server to sync from: then a1's connections may fail, never go in clear.
// Once the API server is back, they are mTLS.
func soakAPIServer(t *testing.T, d time.Duration) {
	c := newKubeCluster(t)
	b := newBed(t, c)
	na := b.nodes[0]
	a1, b1 := na.addPod("a1", "app", true, false), b.nodes[1].addPod("b1", "app", true, false)
	b.knows(na, a1, b1, true)
	var flows, failed, clear int
	check := func(f *flow, mayFail bool) {
		flows++
		if plain := f.plainSegments(); len(plain) > 0 || f.visible {
			clear++
			t.Errorf("a1 -> b1: in clear on the underlay: visible %v, %v", f.visible, plain)
		}
		if mayFail && f.err != nil {
			failed++
			return
		}
		expectMTLS(t, f)
	}
	restarts, agentRestarts := 0, 0
	end := time.Now().Add(d)
	for (restarts < soakAPIRestarts || time.Now().Before(end)) && !t.Failed() {
		v6 := restarts%2 == 1
		c.server.Kill()
		check(b.run(a1, b1, v6), false)
		withAgent := restarts%2 == 1
		if withAgent {
			na.killAgent()
			na.startAgent()
			time.Sleep(time.Duration(500+rand.IntN(1500)) * time.Millisecond)
			check(b.run(a1, b1, !v6), true)
			agentRestarts++
		}
		c.server.StartAgain(t)
		if withAgent {
			na.waitAgent()
		}
		b.knows(na, a1, b1, true)
		check(b.run(a1, b1, v6), false)
		restarts++
	}
	t.Logf("soak %s: %d API server restarts (SIGKILL), %d node agent restarts (SIGKILL) while it was down, "+
		"%d flows a1 -> b1 (%d failed while node-a's agent had no API server), %d segments on the underlay, %d flows in clear",
		d, restarts, agentRestarts, flows, failed, len(b.underlay.Segments()), clear)
}
