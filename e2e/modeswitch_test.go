// SPDX-License-Identifier: Apache-2.0

package e2e_test

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"slices"
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

// TestModeSwitch switches node-a from the in-pod mode to l2 and back, as
// an operator does (agent and mTLS agent restarted in the other mode),
// while its enrolled pod sends to an enrolled pod of node-b, with the real
// l2 datapath and real in-pod rules in the same pod. Each way, nothing of
// the enrolled pod crosses the underlay in clear: the old mode's
// redirection holds its connections (refused or dropped, with the old
// mTLS agent gone) until the new mode steers it, and then leaves; after
// each switch its traffic is tunnelled, both ways.
func TestModeSwitch(t *testing.T) {
	b := newBedWith(t, newFolderCluster(t), bedConfig{inPod: true})
	na, nb := b.nodes[0], b.nodes[1]
	a1, aplain := na.addPod("a1", "app", true, false), na.addPod("aplain", "app", false, false)
	r := nb.addPod("r", "app", true, false)
	b.knows(na, a1, r, true)
	b.knows(nb, r, a1, true)
	expectMTLS(t, b.run(a1, r, false))
	if !inPodRulesPresent(t, a1) {
		t.Fatal("a1 does not hold the in-pod redirection before the switch")
	}

	// With loose pickup off, conntrack does not take a segment of a
	// connection it does not know (or forgot) for a new one, which the
	// in-pod rules would redirect; a short close-wait timeout makes it
	// forget a connection whose peer closed within the test's time.
	a1.ns.Sysctl(t, "netfilter/nf_conntrack_tcp_loose", "0")
	a1.ns.Sysctl(t, "netfilter/nf_conntrack_tcp_timeout_close_wait", "1")

	t.Run("inpod to l2", func(t *testing.T) {
		// A connection ztunnel holds for a1, open across the switch: its
		// end goes with ztunnel, a1's lives on, and what a1 writes on it
		// once conntrack forgot it must not leave in clear.
		pooled := openEcho(t, a1, netip.AddrPortFrom(r.ip4, echoPort))
		pooled.roundTrip(t, newMarker("before"))
		switchUnderTraffic(t, b, na, false, a1, aplain, r, func() error {
			if inPodRulesPresent(t, a1) {
				return errors.New("the in-pod redirection is still in a1's namespace")
			}
			return nil
		})
		expectClosedNotInTheClear(t, b, pooled, "ztunnel")
	})
	t.Run("l2 to inpod", func(t *testing.T) {
		// A connection the l2 proxy holds for a1, open across the switch.
		// The proxy's end goes with it; a1's lives on, and what a1 writes
		// on it after the switch must not leave in clear.
		pooled := openEcho(t, a1, netip.AddrPortFrom(r.ip4, echoPort))
		pooled.roundTrip(t, newMarker("before"))
		switchUnderTraffic(t, b, na, true, a1, aplain, r, func() error {
			if err := inPodInPlace(a1); err != nil {
				return err
			}
			if pins, _ := os.ReadDir(na.bpfRoot); len(pins) > 0 {
				return fmt.Errorf("the l2 datapath's %d pins are still under %s", len(pins), na.bpfRoot)
			}
			return nil
		})
		expectClosedNotInTheClear(t, b, pooled, "the l2 proxy")
	})
}

// expectClosedNotInTheClear writes on a connection the old mode's mTLS agent
// held, after the switch: nothing of it may cross the underlay in clear,
// and no answer come back.
func expectClosedNotInTheClear(t *testing.T, b *bed, pooled *echoConn, heldBy string) {
	t.Helper()
	late := newMarker("late")
	b.underlay.Watch(late)
	pooled.c.SetDeadline(time.Now().Add(time.Second))
	_, werr := pooled.c.Write(requestBody(late, inPodPayload))
	_, rerr := pooled.r.ReadString('\n')
	time.Sleep(captureLag)
	t.Logf("on the connection %s held, after the switch: write %v, read %v", heldBy, werr, rerr)
	if rerr == nil {
		t.Errorf("the connection %s held answered after the switch", heldBy)
	}
	if seen := b.underlay.Seen(late); len(seen) > 0 {
		t.Errorf("the payload of a connection %s held crossed the underlay in clear after the switch: %s", heldBy, seen[0])
	}
}

// switchUnderTraffic switches node n to the in-pod mode or l2 while the
// enrolled pod and the plain pod send to r, until the switch is complete
// and the enrolled pod was answered since; then checks that nothing of
// the enrolled pod crossed the underlay in clear, and that it is
// tunnelled both ways.
//
// A bare reset of the enrolled pod (no payload, to a peer that never had
// the connection) may cross the underlay: from l2, the stopping l2 proxy
// removes its capture before its sockets are done, so the pod's
// acknowledgement of their FIN, steered there, is dropped, and the
// orphaned sockets send the FIN again, which the released pod answers
// with a reset; from inpod, the agent closes the pod's connections, and
// one conntrack forgot sends its reset out rather than to ztunnel's side.
func switchUnderTraffic(t *testing.T, b *bed, n *bedNode, inPod bool, enrolled, plain, r *bedPod, complete func() error) {
	bareReset := func(s netnstest.Segment) bool {
		return s.RST && s.Payload == 0 && (s.Src.Addr() == enrolled.ip4 || s.Src.Addr() == enrolled.ip6)
	}
	enrolledMarker, plainMarker := newMarker("enrolled"), newMarker("plain")
	b.underlay.Watch(enrolledMarker)
	b.underlay.Watch(plainMarker)
	first := len(b.underlay.Segments())
	var (
		mu      sync.Mutex
		results = map[*bedPod][]error{}
		wrong   []string
		done    = make(chan struct{})
		senders sync.WaitGroup
	)
	for _, p := range []*bedPod{enrolled, plain} {
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
	// answered counts p's requests answered from its request number from.
	answered := func(p *bedPod, from int) (sent, ok int) {
		mu.Lock()
		defer mu.Unlock()
		for _, err := range results[p][min(from, len(results[p])):] {
			if err == nil {
				ok++
			}
		}
		return len(results[p]), ok
	}
	b.eventually("both pods answered before the switch", func() error {
		if _, e := answered(enrolled, 0); e == 0 {
			return errors.New("not yet")
		}
		if _, p := answered(plain, 0); p == 0 {
			return errors.New("not yet")
		}
		return nil
	})

	began := time.Now()
	n.switchMode(inPod)
	b.eventually("the switch complete", complete)
	t.Logf("switch complete %s after it began", time.Since(began).Round(time.Millisecond))
	b.knows(n, enrolled, r, true)
	since, _ := answered(enrolled, 0)
	b.eventually(enrolled.name+" answered in the new mode", func() error {
		if _, ok := answered(enrolled, since); ok == 0 {
			return errors.New("no request answered since the switch completed")
		}
		return nil
	})
	close(done)
	senders.Wait()
	time.Sleep(captureLag)

	for _, w := range wrong {
		t.Error(w)
	}
	sentE, okE := answered(enrolled, 0)
	sentP, okP := answered(plain, 0)
	t.Logf("%s sent %d requests, %d answered (the others refused or dropped during the switch); %s %d, %d answered",
		enrolled, sentE, okE, plain, sentP, okP)
	var leaked []netnstest.Segment
	for _, s := range b.underlay.Segments()[first:] {
		ends := []netip.Addr{s.Src.Addr(), s.Dst.Addr()}
		ofEnrolled := slices.Contains(ends, enrolled.ip4) || slices.Contains(ends, enrolled.ip6)
		if ofEnrolled && s.Src.Port() != proxy.HBONEPort && s.Dst.Port() != proxy.HBONEPort && !bareReset(s) {
			leaked = append(leaked, s)
		}
	}
	for i, s := range leaked {
		if i == 10 {
			t.Errorf("... %d more", len(leaked)-10)
			break
		}
		t.Errorf("%s's TCP outside HBONE on the underlay: %s", enrolled, s)
	}
	if seen := b.underlay.Seen(enrolledMarker); len(seen) > 0 {
		t.Errorf("%s's payload crossed the underlay in clear: %s", enrolled, seen[0])
	}
	// Without these, no leak proves nothing.
	if len(b.underlay.Seen(plainMarker)) == 0 {
		t.Errorf("%s's payload was never seen on the underlay: the capture proves nothing", plain)
	}
	if err := b.underlay.Err(); err != nil || b.underlay.Dropped() > 0 {
		t.Errorf("capture: %v, %d dropped", err, b.underlay.Dropped())
	}

	for _, v6 := range []bool{false, true} {
		for _, c := range []struct{ from, to *bedPod }{{enrolled, r}, {r, enrolled}} {
			f := b.run(c.from, c.to, v6)
			f.segments = slices.DeleteFunc(f.segments, bareReset)
			t.Log(f)
			expectMTLS(t, f)
		}
	}
	b.eventually(n.name+"'s bypass check", func() error { return n.noBypass(enrolled.name) })
}
