// SPDX-License-Identifier: Apache-2.0

package redirect_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"
	"github.com/spf13/pflag"

	"github.com/mtlsbridge/mtlsbridge/bpf"
	"github.com/mtlsbridge/mtlsbridge/internal/netnstest"
	"github.com/mtlsbridge/mtlsbridge/metrics"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/enrollment"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/redirect"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/steering"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/steering/steeringtest"
	"github.com/mtlsbridge/mtlsbridge/tables"
	"github.com/mtlsbridge/mtlsbridge/tables/ingest"
)

// TestOtherModeTakesOverPodByPod: an agent in another mode
// (--redirect-mode=inpod) loads no program and writes no entry, and takes
// over what an l2 agent left pinned pod by pod: an enrolled pod's TCP goes
// on to the l2 mTLS agent until the in-pod mode steers the pod (never
// directly, in clear); then the in-pod mode is asked to close the pod's
// connections that agent held, and the pod's TCP goes directly; once no
// pod is left, the map and links are gone.
func TestOtherModeTakesOverPodByPod(t *testing.T) {
	c := newCluster(t)
	c.write(t, manifest{enrollA: true, enrollN: true, withAgent: true})
	first := c.startAgent(t)
	done := reconciler.StatusKindDone
	first.waitFor(t, "a and n steered", func(txn statedb.ReadTxn) bool {
		return first.redirectIs(txn, c.a.IP4, bpf.KindEnrolled, done) && first.redirectIs(txn, c.n.IP6, bpf.KindEnrolled, done) &&
			first.redirectIs(txn, bpf.AgentKey, bpf.KindAgent, done) &&
			first.attachmentIs(txn, c.a.HostIf, done) && first.attachmentIs(txn, c.n.HostIf, done)
	})
	for _, p := range []*netnstest.Pod{c.a, c.n} {
		if got, err := p.Ask(netip.AddrPortFrom(c.r.IP4, 8080)); err != nil || got.Server != "agent" {
			t.Fatalf("in l2 mode, %s -> r: %v %v, want the agent", p.Name, got, err)
		}
	}
	// A connection of a's that the agent holds, left open.
	var held net.Conn
	must(t, c.a.Do(func() (err error) {
		held, err = net.Dial("tcp", netip.AddrPortFrom(c.r.IP6, 8080).String())
		return err
	}))
	defer held.Close()
	heldConn := steering.Conn{Local: netip.MustParseAddrPort(held.LocalAddr().String()), Remote: netip.MustParseAddrPort(held.RemoteAddr().String())}
	first.stop(t)

	root := filepath.Join(c.bpfRoot, "agent")
	inPod := steeringtest.New(steering.ModeInPod)
	var redirects statedb.Table[*redirect.Redirect]
	var db *statedb.DB
	h := hive.New(cell.SimpleHealthCell, job.Cell, statedb.Cell,
		metrics.Cell, tables.Cell, ingest.Cell, enrollment.Cell, steering.Cell, redirect.Cell,
		// The in-pod mode has tests of its own; here it steers what the
		// test says.
		cell.Provide(inPod.Out),
		cell.Invoke(func(d *statedb.DB, r statedb.Table[*redirect.Redirect]) { db, redirects = d, r }))
	flags := pflag.NewFlagSet("", pflag.ContinueOnError)
	h.RegisterFlags(flags)
	must(t, flags.Parse([]string{"--source=dir:" + c.manifests, "--node-name=node-a", "--bpf-root=" + root,
		"--node-netns=/var/run/netns/" + c.node1.Name, "--devices=" + netnstest.UplinkName, "--redirect-mode=inpod"}))
	log := hivetest.Logger(t)
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	must(t, h.Start(log, ctx))
	t.Cleanup(func() { h.Stop(log, context.Background()) })
	m, err := ebpf.LoadPinnedMap(filepath.Join(root, bpf.MapName), &ebpf.LoadPinOptions{ReadOnly: true})
	must(t, err)
	defer m.Close()
	entries := bpf.NewRedirectMap(m)
	kindOf := func(addr netip.Addr) bpf.Kind {
		e, _, err := entries.Lookup(addr)
		must(t, err)
		return e.Kind
	}
	eventually := func(what string, cond func() error) {
		t.Helper()
		deadline := time.Now().Add(waitTimeout)
		for err := cond(); err != nil; err = cond() {
			if time.Now().After(deadline) {
				t.Fatalf("%s: %v", what, err)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}

	// n steered by the in-pod mode: its entries are released, a's stay.
	inPod.Steer("app/n")
	eventually("n released", func() error {
		for _, ip := range []netip.Addr{c.n.IP4, c.n.IP6} {
			if k := kindOf(ip); k != bpf.KindLocal {
				return fmt.Errorf("n's %s is %s", ip, k)
			}
		}
		return nil
	})
	for _, ip := range []netip.Addr{c.a.IP4, c.a.IP6} {
		if k := kindOf(ip); k != bpf.KindEnrolled {
			t.Errorf("a's %s is %s before the in-pod mode steers a, want enrolled", ip, k)
		}
	}
	if got, err := c.a.Ask(netip.AddrPortFrom(c.r.IP4, 8080)); err != nil || got.Server != "agent" {
		t.Errorf("a not yet steered by the in-pod mode, a -> r: %v %v, want the l2 agent still", got, err)
	}
	if got, err := c.n.Ask(netip.AddrPortFrom(c.r.IP6, 8080)); err != nil || got.Server != "r" {
		t.Errorf("n steered by the in-pod mode, n -> r: %v %v, want r directly", got, err)
	}
	if closed := inPod.Closed("app/a"); len(closed) > 0 {
		t.Errorf("a's connections closed before the in-pod mode steers a: %v", closed)
	}

	// a too: nothing is left to hand over, the pins go.
	inPod.Steer("app/a")
	eventually("the l2 pins removed", func() error {
		for _, pin := range bpf.MapPins(root) {
			if _, err := os.Stat(pin); !errors.Is(err, os.ErrNotExist) {
				return fmt.Errorf("%s: %v", pin, err)
			}
		}
		if links, _ := os.ReadDir(filepath.Join(root, "links")); len(links) > 0 {
			return fmt.Errorf("links %v", links)
		}
		return nil
	})
	if got, err := c.a.Ask(netip.AddrPortFrom(c.r.IP4, 8080)); err != nil || got.Server != "r" {
		t.Errorf("in the in-pod mode, a -> r: %v %v, want r directly", got, err)
	}
	if closed := inPod.Closed("app/a"); !slices.Contains(closed, heldConn) {
		t.Errorf("the in-pod mode was asked to close %v of a's connections, want the one the agent held, %v", closed, heldConn)
	}
	if n := redirects.NumObjects(db.ReadTxn()); n != 0 {
		t.Errorf("%d redirects in another mode", n)
	}
	if ok, _ := redirects.Initialized(db.ReadTxn()); !ok {
		t.Error("redirects not initialized in another mode: readiness would wait forever")
	}
}
