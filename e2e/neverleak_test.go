// SPDX-License-Identifier: Apache-2.0

package e2e_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mtlsbridge/mtlsbridge/internal/netnstest"
)

// Size of TestNeverLeak: restarts of the agent (SIGKILL each time) and pods
// started and deleted meanwhile, bounded in time.
const (
	minRestarts = 15
	minPods     = 40
	maxPods     = 140 // within maxAddrs
	concurrency = 6
	chaosLimit  = 3 * time.Minute
)

// TestNeverLeak: pods start before the agent exists, and while it is
// killed with SIGKILL and restarted over and over, pods come and go. A pod
// may start only once its redirect is in the pinned map; an enrolled pod's
// connections are always answered by the mTLS agent; and a capture on the
// node's uplink shows no TCP payload from an enrolled pod's address.
func TestNeverLeak(t *testing.T) {
	n := newNode(t)
	ctx, cancel := context.WithTimeout(context.Background(), chaosLimit+addTimeout)
	defer cancel()

	var (
		tr       traffic
		pods     atomic.Int64
		failures atomic.Int64
		wg       sync.WaitGroup
		done     = make(chan struct{})
	)
	// kubelet: pods start and go, concurrency at a time, the first ones
	// before any agent runs.
	podsDone := make(chan struct{})
	go func() {
		defer close(podsDone)
		slots := make(chan struct{}, concurrency)
		defer wg.Wait()
	start:
		for i := range maxPods {
			select {
			case <-done:
				break start
			case slots <- struct{}{}:
			}
			wg.Add(1)
			go func() {
				defer func() { <-slots; wg.Done() }()
				p := n.newPod(fmt.Sprintf("p%d", i), i%3 != 2) // two of three enrolled
				hostIf, failed, err := n.startSandbox(ctx, p)
				failures.Add(int64(failed))
				if err != nil {
					t.Error(err)
					return
				}
				pods.Add(1)
				// The kubelet writes the addresses some time after ADD.
				written := make(chan struct{})
				go func() {
					time.Sleep(time.Duration(rand.IntN(500)) * time.Millisecond)
					n.writePod(p, true)
					close(written)
				}()
				stop := make(chan struct{})
				ran := make(chan struct{})
				go func() { n.run(p, stop, &tr); close(ran) }()
				time.Sleep(time.Duration(300+rand.IntN(1200)) * time.Millisecond)
				close(stop)
				<-ran
				if err := n.runtime.Del(context.Background(), p.sb); err != nil {
					t.Errorf("DEL of %s (%s): %v", p.name, hostIf, err)
				}
				<-written
				n.deletePod(p)
			}()
		}
		<-done
	}()

	// The agent: first after a while (pods are waiting), then killed and
	// restarted, up to minRestarts times and until minPods pods ran.
	deadline := time.Now().Add(chaosLimit)
	restarts := n.restartUntil(t, func(restarts int) bool {
		return (restarts >= minRestarts && pods.Load() >= minPods) || time.Now().After(deadline)
	})
	close(done)
	<-podsDone

	leaked, plain := n.checkNoLeak(t, &tr)
	t.Logf("%d agent restarts (SIGKILL), %d pods started and deleted (%d failed ADDs retried), "+
		"%d connections from pods (%d answered by the mTLS agent, %d directly, %d failed), "+
		"%d segments captured on the uplink (%d with payload from pods not enrolled, %d from enrolled pods, %d of them with payload)",
		restarts, pods.Load(), failures.Load(), tr.sent.Load(), tr.agent.Load(), tr.direct.Load(), tr.failed.Load(),
		len(n.capture.Segments()), plain, len(leaked), payload(leaked))
	if restarts < minRestarts || pods.Load() < minPods {
		t.Errorf("ran %d restarts and %d pods in %s, want at least %d and %d", restarts, pods.Load(), chaosLimit, minRestarts, minPods)
	}
}

// restartUntil starts the node agent after a while (pods are waiting for
// it), then kills (SIGKILL) and restarts it until enough; it returns the
// number of restarts, with the agent running.
func (n *node) restartUntil(t *testing.T, enough func(restarts int) bool) int {
	time.Sleep(1500 * time.Millisecond)
	restarts := 0
	for !enough(restarts) && !t.Failed() {
		n.start()
		time.Sleep(time.Duration(500+rand.IntN(2000)) * time.Millisecond)
		n.kill()
		restarts++
		time.Sleep(time.Duration(rand.IntN(500)) * time.Millisecond)
	}
	n.start()
	return restarts
}

// checkNoLeak fails t for each segment from an enrolled pod on the uplink
// (n.leaks), and when the capture missed segments or saw no pod traffic at
// all (then no leak proves nothing).
func (n *node) checkNoLeak(t *testing.T, tr *traffic) (leaked []netnstest.Segment, plain int) {
	t.Helper()
	leaked, plain = n.leaks()
	for i, s := range leaked {
		if i == 10 {
			t.Errorf("... %d more", len(leaked)-10)
			break
		}
		t.Errorf("leaked on the uplink: %s", s)
	}
	if err := n.capture.Err(); err != nil || n.capture.Dropped() > 0 {
		t.Errorf("capture: %v, %d dropped", err, n.capture.Dropped())
	}
	if plain == 0 || tr.agent.Load() == 0 {
		t.Errorf("no payload from pods not enrolled on the uplink (%d), or no connection through the agent (%d)", plain, tr.agent.Load())
	}
	return leaked, plain
}
