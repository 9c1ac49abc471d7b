// SPDX-License-Identifier: Apache-2.0

package redirect_test

import (
	"fmt"
	"net/netip"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/mtlsbridge/mtlsbridge/bpf"
	"github.com/mtlsbridge/mtlsbridge/internal/netnstest"
)

// TestRestartWithoutGap stops the agent and starts a new one while a
// watcher reads the pinned map and pod a keeps opening connections to r:
// no live entry ever goes or changes, every connection reaches the agent,
// and an entry made stale while the agent was down (pod n deleted) is
// pruned once the new agent has synced.
func TestRestartWithoutGap(t *testing.T) {
	c := newCluster(t)
	c.write(t, manifest{enrollA: true, withAgent: true})
	first := c.startAgent(t)
	done := reconciler.StatusKindDone
	first.waitFor(t, "entries and attachments in place", func(txn statedb.ReadTxn) bool {
		return first.redirectIs(txn, c.a.IP4, bpf.KindEnrolled, done) && first.redirectIs(txn, bpf.AgentKey, bpf.KindAgent, done) &&
			first.redirectIs(txn, c.n.IP4, bpf.KindLocal, done) &&
			first.attachmentIs(txn, c.a.HostIf, done) && first.attachmentIs(txn, netnstest.UplinkName, done)
	})

	pinned, err := ebpf.LoadPinnedMap(filepath.Join(c.bpfRoot, "agent", bpf.MapName), &ebpf.LoadPinOptions{ReadOnly: true})
	must(t, err)
	defer pinned.Close()
	m := bpf.NewRedirectMap(pinned)
	before, err := m.Dump()
	must(t, err)
	stale := []netip.Addr{c.n.IP4, c.n.IP6}
	live := map[netip.Addr]bpf.Entry{}
	for addr, e := range before {
		live[addr] = e
	}
	for _, addr := range stale {
		if _, ok := live[addr]; !ok {
			t.Fatalf("no entry for %s before the restart: %v", addr, before)
		}
		delete(live, addr)
	}
	linkBefore := linkInfo(t, c, c.a.HostIf)

	// The watchers run until told to stop, bounded in time.
	stop := make(chan struct{})
	var (
		wg                 sync.WaitGroup
		mu                 sync.Mutex
		violations         []string
		reads, connections int
	)
	report := func(format string, args ...any) {
		mu.Lock()
		defer mu.Unlock()
		if len(violations) < 20 {
			violations = append(violations, fmt.Sprintf(format, args...))
		}
	}
	wg.Add(2)
	go func() {
		defer wg.Done()
		for deadline := time.Now().Add(2 * waitTimeout); time.Now().Before(deadline); {
			select {
			case <-stop:
				return
			default:
			}
			now, err := m.Dump()
			if err != nil {
				report("dump: %v", err)
				continue
			}
			for addr, want := range live {
				if got, ok := now[addr]; !ok || !got.Equal(want) {
					report("entry of %s: %v (present %v), want %v", addr, got, ok, want)
				}
			}
			mu.Lock()
			reads++
			mu.Unlock()
		}
	}()
	go func() {
		defer wg.Done()
		for deadline := time.Now().Add(2 * waitTimeout); time.Now().Before(deadline); {
			select {
			case <-stop:
				return
			case <-time.After(20 * time.Millisecond):
			}
			ans, err := c.a.Ask(netip.AddrPortFrom(c.r.IP4, 8080))
			if err != nil || ans.Server != "agent" {
				report("a -> r: %v, %v", ans, err)
			}
			mu.Lock()
			connections++
			mu.Unlock()
		}
	}()

	// The agent goes; while it is down, pod n is deleted; a new agent
	// comes.
	first.stop(t)
	c.write(t, manifest{enrollA: true, withAgent: true, withoutN: true})
	time.Sleep(200 * time.Millisecond)
	second := c.startAgent(t)
	second.waitFor(t, "n's entries pruned, a's in place", func(txn statedb.ReadTxn) bool {
		now, err := m.Dump()
		if err != nil {
			return false
		}
		_, n4 := now[c.n.IP4]
		_, n6 := now[c.n.IP6]
		return !n4 && !n6 && second.redirectIs(txn, c.a.IP4, bpf.KindEnrolled, done) && second.attachmentIs(txn, c.a.HostIf, done)
	})
	time.Sleep(200 * time.Millisecond) // a few more reads and connections after the prune
	close(stop)
	wg.Wait()

	for _, v := range violations {
		t.Error(v)
	}
	if reads < 10 || connections < 5 {
		t.Errorf("the watchers did too little: %d reads, %d connections", reads, connections)
	}
	t.Logf("%d map reads and %d connections across the restart", reads, connections)

	// The new agent took the link over: same link, its own program, first.
	linkAfter := linkInfo(t, c, c.a.HostIf)
	if linkAfter.Program == linkBefore.Program || !linkAfter.First || linkAfter.Ifindex != c.a.HostIndex {
		t.Errorf("link of %s: before %+v, after %+v", c.a.HostIf, linkBefore, linkAfter)
	}
}

func linkInfo(t *testing.T, c *cluster, device string) bpf.LinkInfo {
	t.Helper()
	var li bpf.LinkInfo
	must(t, c.node1.Do(func() (err error) {
		li, err = bpf.PinnedLink(filepath.Join(c.bpfRoot, "agent", "links", device))
		return err
	}))
	return li
}
