// SPDX-License-Identifier: Apache-2.0

package e2e_test

import (
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/mtlsbridge/mtlsbridge/internal/netnstest"
	"github.com/mtlsbridge/mtlsbridge/proxy"
)

// Bounds of the traffic that runs through a mode switch.
const (
	switchInterval    = 50 * time.Millisecond
	switchMaxRequests = 2000 // per sender: 100 s at the interval, beyond bedTimeout's waits
)

// TestModeSwitch switches node-a from the in-pod mode to l2 as an operator
// does (agent and mTLS agent restarted in the other mode) while its
// enrolled pod sends to an enrolled pod of node-b, with the real l2
// datapath and real in-pod rules in the same pod: nothing of the enrolled
// pod crosses the underlay in clear (its in-pod redirection refuses its
// connections until the l2 datapath steers it), the redirection leaves
// the pod once that datapath steers it, and its traffic is tunnelled
// again, by the l2 proxy, both ways.
func TestModeSwitch(t *testing.T) {
	b := newBedMode(t, newFolderCluster(t), true)
	na, nb := b.nodes[0], b.nodes[1]
	a1, aplain := na.addPod("a1", "app", true, false), na.addPod("aplain", "app", false, false)
	r := nb.addPod("r", "app", true, false)
	b.knows(na, a1, r, true)
	b.knows(nb, r, a1, true)
	expectMTLS(t, b.run(a1, r, false))
	if !inPodRulesPresent(t, a1) {
		t.Fatal("a1 does not hold the in-pod redirection before the switch")
	}

	enrolledMarker, plainMarker := newMarker("enrolled"), newMarker("plain")
	b.underlay.Watch(enrolledMarker)
	b.underlay.Watch(plainMarker)
	var (
		mu      sync.Mutex
		results = map[*bedPod][]error{}
		wrong   []string
		done    = make(chan struct{})
		senders sync.WaitGroup
	)
	for _, p := range []*bedPod{a1, aplain} {
		marker := plainMarker
		if p.enrolled {
			marker = enrolledMarker
		}
		body := requestBody(marker, inPodPayload)
		senders.Go(func() {
			for i := 0; i < switchMaxRequests; i++ {
				select {
				case <-done:
					return
				case <-time.After(switchInterval):
				}
				reply, err := send(p, netip.AddrPortFrom(r.addr(i%2 == 1), digestPort), body)
				mu.Lock()
				results[p] = append(results[p], err)
				if err == nil && reply.server != r.name {
					wrong = append(wrong, fmt.Sprintf("%s reached %s, not %s", p, reply.server, r))
				}
				mu.Unlock()
			}
		})
	}
	// answered counts p's requests answered since its request number from.
	answered := func(p *bedPod, from int) int {
		mu.Lock()
		defer mu.Unlock()
		n := 0
		for _, err := range results[p][min(from, len(results[p])):] {
			if err == nil {
				n++
			}
		}
		return n
	}
	sent := func(p *bedPod) int {
		mu.Lock()
		defer mu.Unlock()
		return len(results[p])
	}
	b.eventually("both pods answered before the switch", func() error {
		if answered(a1, 0) == 0 || answered(aplain, 0) == 0 {
			return errors.New("not yet")
		}
		return nil
	})

	switchedAt := time.Now()
	na.switchMode(false)
	b.eventually("a1's in-pod redirection removed once the l2 datapath steers it", func() error {
		if inPodRulesPresent(t, a1) {
			return errors.New("still in a1's namespace")
		}
		return nil
	})
	t.Logf("in-pod rules left a1 %s after the switch began", time.Since(switchedAt).Round(time.Millisecond))
	b.knows(na, a1, r, true)
	since := sent(a1)
	b.eventually("a1 answered through node-a's l2 proxy", func() error {
		if answered(a1, since) == 0 {
			return errors.New("no request answered since the in-pod rules left")
		}
		return nil
	})
	close(done)
	senders.Wait()
	time.Sleep(captureLag)

	for _, w := range wrong {
		t.Error(w)
	}
	refused := len(results[a1]) - answered(a1, 0)
	t.Logf("a1 sent %d requests, %d answered (%d refused or failed during the switch); aplain %d, %d answered",
		len(results[a1]), answered(a1, 0), refused, len(results[aplain]), answered(aplain, 0))
	var leaked []netnstest.Segment
	for _, s := range b.underlay.Segments() {
		fromA1 := s.Src.Addr() == a1.ip4 || s.Src.Addr() == a1.ip6 || s.Dst.Addr() == a1.ip4 || s.Dst.Addr() == a1.ip6
		if fromA1 && s.Src.Port() != proxy.HBONEPort && s.Dst.Port() != proxy.HBONEPort {
			leaked = append(leaked, s)
		}
	}
	for i, s := range leaked {
		if i == 10 {
			t.Errorf("... %d more", len(leaked)-10)
			break
		}
		t.Errorf("a1's TCP outside HBONE on the underlay: %s", s)
	}
	if seen := b.underlay.Seen(enrolledMarker); len(seen) > 0 {
		t.Errorf("a1's payload crossed the underlay in clear: %s", seen[0])
	}
	// Without these, no leak proves nothing.
	if len(b.underlay.Seen(plainMarker)) == 0 {
		t.Error("aplain's payload was never seen on the underlay: the capture proves nothing")
	}
	if err := b.underlay.Err(); err != nil || b.underlay.Dropped() > 0 {
		t.Errorf("capture: %v, %d dropped", err, b.underlay.Dropped())
	}

	// After the switch: both ways mTLS, through node-a's l2 proxy.
	for _, v6 := range []bool{false, true} {
		for _, c := range []struct{ from, to *bedPod }{{a1, r}, {r, a1}} {
			f := b.run(c.from, c.to, v6)
			t.Log(f)
			expectMTLS(t, f)
		}
	}
	b.eventually("node-a's bypass check", func() error { return na.noBypass("a1") })
}
