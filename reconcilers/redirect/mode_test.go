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
	"github.com/mtlsbridge/mtlsbridge/nodenetns"
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
// connections that agent held, and once it did (or cannot, ever) the
// pod's TCP goes directly; once no pod is left, the map and links are
// gone.
func TestOtherModeTakesOverPodByPod(t *testing.T) {
	c := newCluster(t)
	c.write(t, manifest{enrollA: true, enrollN: true, withAgent: true})
	c.steerInL2(t, c.a, c.n)
	// A connection of a's that the agent holds, left open.
	var held net.Conn
	must(t, c.a.Do(func() (err error) {
		held, err = net.Dial("tcp", netip.AddrPortFrom(c.r.IP6, 8080).String())
		return err
	}))
	defer held.Close()
	heldConn := steering.Conn{Local: netip.MustParseAddrPort(held.LocalAddr().String()), Remote: netip.MustParseAddrPort(held.RemoteAddr().String())}
	o := c.startOtherMode(t)

	// n steered by the in-pod mode: its entries are released, a's stay.
	o.inPod.Steer("app/n")
	o.eventually(t, "n released", func() error { return o.entriesAre(c.n, bpf.KindLocal) })
	if err := o.entriesAre(c.a, bpf.KindEnrolled); err != nil {
		t.Errorf("before the in-pod mode steers a: %v", err)
	}
	if got, err := c.a.Ask(netip.AddrPortFrom(c.r.IP4, 8080)); err != nil || got.Server != "agent" {
		t.Errorf("a not yet steered by the in-pod mode, a -> r: %v %v, want the l2 agent still", got, err)
	}
	if got, err := c.n.Ask(netip.AddrPortFrom(c.r.IP6, 8080)); err != nil || got.Server != "r" {
		t.Errorf("n steered by the in-pod mode, n -> r: %v %v, want r directly", got, err)
	}
	if closed := o.inPod.Closed("app/a"); len(closed) > 0 {
		t.Errorf("a's connections closed before the in-pod mode steers a: %v", closed)
	}

	// a too, but its connections cannot be closed: it stays.
	o.inPod.FailClose(errors.New("test: cannot close"))
	o.inPod.Steer("app/a")
	o.eventually(t, "a's connections asked to be closed", func() error {
		if !slices.Contains(o.inPod.Closed("app/a"), heldConn) {
			return fmt.Errorf("asked to close %v of a's connections, want the one the agent held, %v", o.inPod.Closed("app/a"), heldConn)
		}
		return nil
	})
	if err := o.entriesAre(c.a, bpf.KindEnrolled); err != nil {
		t.Errorf("a's connections not closed: %v", err)
	}
	// A kernel that cannot close sockets at all (no
	// CONFIG_INET_DIAG_DESTROY) would keep it cut off for good: it goes.
	// Nothing is left to hand over, the pins go.
	o.inPod.FailClose(steering.ErrCannotClose)
	o.eventually(t, "the l2 pins removed", o.pinsGone)
	if got, err := c.a.Ask(netip.AddrPortFrom(c.r.IP4, 8080)); err != nil || got.Server != "r" {
		t.Errorf("in the in-pod mode, a -> r: %v %v, want r directly", got, err)
	}
	if n := o.redirects.NumObjects(o.db.ReadTxn()); n != 0 {
		t.Errorf("%d redirects in another mode", n)
	}
	if ok, _ := o.redirects.Initialized(o.db.ReadTxn()); !ok {
		t.Error("redirects not initialized in another mode: readiness would wait forever")
	}
}

// TestHandOverPodGoneFromAPI: the entries of a pod the API no longer shows
// stay while its interface is there (its sandbox may still run: a forced
// deletion), and go with it.
func TestHandOverPodGoneFromAPI(t *testing.T) {
	c := newCluster(t)
	c.write(t, manifest{enrollA: true, withAgent: true})
	c.steerInL2(t, c.a)
	c.write(t, manifest{withoutA: true, withAgent: true})
	o := c.startOtherMode(t)
	o.inPod.SteerAll()
	time.Sleep(time.Second) // a few rounds of the hand-over
	if err := o.entriesAre(c.a, bpf.KindEnrolled); err != nil {
		t.Fatalf("a left the API, its interface is there: %v", err)
	}
	if got, err := c.a.Ask(netip.AddrPortFrom(c.r.IP4, 8080)); err != nil || got.Server != "agent" {
		t.Errorf("a -> r: %v %v, want the l2 agent still", got, err)
	}
	h := c.node1.Netlink(t)
	link, err := h.LinkByName(c.a.HostIf)
	must(t, err)
	must(t, h.LinkDel(link))
	o.eventually(t, "the l2 pins removed once a's interface is gone", o.pinsGone)
}

// steerInL2 runs an agent of the l2 mode until it steers the pods, which
// then ask the mTLS agent, and stops it: its pins stay.
func (c *cluster) steerInL2(t *testing.T, pods ...*netnstest.Pod) {
	t.Helper()
	first := c.startAgent(t)
	done := reconciler.StatusKindDone
	first.waitFor(t, "the pods steered", func(txn statedb.ReadTxn) bool {
		for _, p := range pods {
			if !first.redirectIs(txn, p.IP4, bpf.KindEnrolled, done) || !first.redirectIs(txn, p.IP6, bpf.KindEnrolled, done) ||
				!first.attachmentIs(txn, p.HostIf, done) {
				return false
			}
		}
		return first.redirectIs(txn, bpf.AgentKey, bpf.KindAgent, done)
	})
	for _, p := range pods {
		if got, err := p.Ask(netip.AddrPortFrom(c.r.IP4, 8080)); err != nil || got.Server != "agent" {
			t.Fatalf("in l2 mode, %s -> r: %v %v, want the agent", p.Name, got, err)
		}
	}
	first.stop(t)
}

// otherModeAgent is an agent in the in-pod mode, whose steering the test
// decides (the in-pod mode has tests of its own).
type otherModeAgent struct {
	inPod     *steeringtest.Mode
	db        *statedb.DB
	redirects statedb.Table[*redirect.Redirect]
	root      string
	entries   *bpf.RedirectMap
}

func (c *cluster) startOtherMode(t *testing.T) *otherModeAgent {
	t.Helper()
	o := &otherModeAgent{inPod: steeringtest.New(steering.ModeInPod), root: filepath.Join(c.bpfRoot, "agent")}
	h := hive.New(cell.SimpleHealthCell, job.Cell, statedb.Cell,
		metrics.Cell, tables.Cell, ingest.Cell, enrollment.Cell, steering.Cell, nodenetns.Cell, redirect.Cell,
		cell.Provide(o.inPod.Out),
		cell.Invoke(func(d *statedb.DB, r statedb.Table[*redirect.Redirect]) { o.db, o.redirects = d, r }))
	flags := pflag.NewFlagSet("", pflag.ContinueOnError)
	h.RegisterFlags(flags)
	must(t, flags.Parse([]string{"--source=dir:" + c.manifests, "--node-name=node-a", "--bpf-root=" + o.root,
		"--node-netns=/var/run/netns/" + c.node1.Name, "--devices=" + netnstest.UplinkName, "--redirect-mode=inpod"}))
	// Opened before the agent starts, which may remove the pins.
	m, err := ebpf.LoadPinnedMap(filepath.Join(o.root, bpf.MapName), &ebpf.LoadPinOptions{ReadOnly: true})
	must(t, err)
	t.Cleanup(func() { m.Close() })
	o.entries = bpf.NewRedirectMap(m)
	log := hivetest.Logger(t)
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	must(t, h.Start(log, ctx))
	t.Cleanup(func() { h.Stop(log, context.Background()) })
	return o
}

// entriesAre checks that the map's entries of the pod's addresses are of
// the kind.
func (o *otherModeAgent) entriesAre(p *netnstest.Pod, kind bpf.Kind) error {
	for _, ip := range []netip.Addr{p.IP4, p.IP6} {
		e, _, err := o.entries.Lookup(ip)
		if err != nil {
			return err
		}
		if e.Kind != kind {
			return fmt.Errorf("%s's %s is %s, want %s", p.Name, ip, e.Kind, kind)
		}
	}
	return nil
}

func (o *otherModeAgent) pinsGone() error {
	for _, pin := range bpf.MapPins(o.root) {
		if _, err := os.Stat(pin); !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("%s: %v", pin, err)
		}
	}
	if _, err := os.Stat(filepath.Join(o.root, "links")); !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("links folder: %v", err)
	}
	return nil
}

func (o *otherModeAgent) eventually(t *testing.T, what string, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(waitTimeout)
	for err := cond(); err != nil; err = cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: %v", what, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
