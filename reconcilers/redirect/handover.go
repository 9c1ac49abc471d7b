// SPDX-License-Identifier: Apache-2.0

package redirect

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"

	"github.com/mtlsbridge/mtlsbridge/bpf"
	"github.com/mtlsbridge/mtlsbridge/reconcilers"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/enrollment"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/steering"
	"github.com/mtlsbridge/mtlsbridge/statedir"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// In another mode, what an earlier agent of the l2 mode left pinned under
// --bpf-root goes on steering pods' TCP to the l2 mTLS agent's namespace,
// past the other mode's redirection (the BPF twin of Cilium #47303). It
// is handed over pod by pod. An enrolled pod's entries stay until the
// active mode steers it: its new connections go to the l2 mTLS agent, or
// nowhere once it is gone, never in clear. Then the connections that
// agent held for the pod are closed in the pod (their ends there may live
// on, a pooled connection whose peer is gone, and their next segment
// would leave in clear once no entry drops it), and the entries become
// local ones, which the programs pass. Once no pod is left, links and
// maps go.

type handoverParams struct {
	cell.In

	Config      Config
	Mode        steering.Config `optional:"true"`
	Modes       steering.Modes
	DB          *statedb.DB
	Pods        statedb.Table[*tables.Pod]
	CNIPods     statedb.Table[*tables.CNIPod]
	Enrollments statedb.Table[*enrollment.Enrollment]
	Pinned      *PinnedState
	Log         *slog.Logger
	Jobs        job.Group
}

// registerHandover hands the l2 pins over, in another mode.
func registerHandover(p handoverParams) {
	if !inactive(p.Mode) || !p.Config.EnableRedirect {
		return
	}
	p.Jobs.Add(job.OneShot("hand-over-l2-pins", (&handover{p}).run,
		// A failure (logged, and in the module's health) is tried again:
		// pins left in place would hold their pods' connections for good.
		job.WithRetry(-1, &job.ExponentialBackoff{Min: time.Second, Max: time.Minute})))
}

type handover struct{ handoverParams }

const (
	// handoverSettle lets the active mode's tables settle (many rows
	// change at once) before the map is read again.
	handoverSettle = 100 * time.Millisecond
	// handoverPatience is how long pods may wait for the active mode
	// before the module's health says which.
	handoverPatience = 2 * time.Minute
	// handoverRecheck bounds a wait for a change of the tables.
	handoverRecheck = 5 * time.Second
)

func (h *handover) run(ctx context.Context, health cell.Health) error {
	root := h.Config.BPFRoot
	if !l2Pinned(root) {
		health.OK("nothing of the l2 mode pinned")
		return nil // the usual case
	}
	// An l2 agent still running (the other half of a rolling update)
	// holds the folder: wait for it, then take its state over.
	lock, err := statedir.LockFolder(ctx, root, "BPF root", h.Log)
	if err != nil {
		return fmt.Errorf("--bpf-root=%s: %w", root, err)
	}
	defer lock.Release()
	if err := h.handOver(ctx, health); err != nil {
		return fmt.Errorf("the l2 mode's pins under %s: %w", root, err)
	}
	return nil
}

// handOver releases the pods as the active mode steers them, then the
// pins.
func (h *handover) handOver(ctx context.Context, health cell.Health) error {
	root := h.Config.BPFRoot
	mode, err := h.Modes.Active()
	if err != nil {
		return err
	}
	maps, err := openL2Maps(root)
	if err != nil {
		// Removed by hand, or of another layout: the programs, which
		// hold the map, still steer by it. Nothing to release pod by pod:
		// the pins go once the active mode steers every enrolled pod.
		h.Log.Warn("The l2 mode's maps cannot be read: its pins go once every enrolled pod is steered", "root", root, "error", err)
	}
	defer maps.close()
	if !reconcilers.WaitInitialized(ctx, health, h.DB, append([]statedb.TableMeta{h.Pods, h.CNIPods, h.Enrollments}, mode.Tables()...)...) {
		return ctx.Err()
	}
	ws := statedb.NewWatchSet()
	var (
		waitingSince time.Time
		lastHeld     []string
	)
	for {
		txn := h.DB.ReadTxn()
		pods, watch := h.podsOfNode(txn, mode)
		held, err := h.release(txn, mode, maps, pods)
		if err != nil {
			return err
		}
		if len(held) == 0 {
			return removeL2Pins(h.Log, root)
		}
		slices.Sort(held)
		if !slices.Equal(held, lastHeld) {
			waitingSince, lastHeld = time.Now(), held
		}
		msg := fmt.Sprintf("%d enrolled pods (or addresses of pods gone whose interface is there) left with the l2 datapath until the %s mode steers them",
			len(held), mode.Name())
		if time.Since(waitingSince) > handoverPatience {
			health.Degraded(msg, fmt.Errorf("waiting for %s since %s", strings.Join(held[:min(len(held), 10)], ", "), waitingSince.Format(time.RFC3339)))
		} else {
			health.OK(msg)
		}
		ws.Clear()
		ws.Add(watch...)
		// Woken anyway now and then: a pod gone from the API is released
		// once its interface is, which no table says, and patience runs
		// out.
		waitCtx, cancel := context.WithTimeout(ctx, handoverRecheck)
		ws.Wait(waitCtx, handoverSettle)
		cancel()
		if ctx.Err() != nil {
			return ctx.Err()
		}
	}
}

// nodePod is a pod of this node as the hand-over sees it.
type nodePod struct {
	key string
	// addrs are its addresses, its CNI report's and the API's: the map
	// holds the API's, the new mode steers the report's.
	addrs []netip.Addr
	// waiting: enrolled, and not steered by the active mode yet (or its
	// enrollment not derived yet).
	waiting bool
}

// podsOfNode returns this node's pods by address.
func (h *handover) podsOfNode(txn statedb.ReadTxn, mode steering.Mode) (map[netip.Addr]*nodePod, []<-chan struct{}) {
	byAddr := map[netip.Addr]*nodePod{}
	pods, podsWatch := h.Pods.ListWatch(txn, tables.PodsOfThisNode())
	_, cniWatch := h.CNIPods.AllWatch(txn)
	_, enrollWatch := h.Enrollments.AllWatch(txn)
	for pod := range pods {
		reported := tables.PodAddrs(txn, h.CNIPods, pod)
		p := &nodePod{key: pod.Key(), addrs: slices.Concat(reported, pod.IPs)}
		e, _, derived := h.Enrollments.Get(txn, enrollment.ByKey(pod.Key()))
		switch {
		case !derived:
			p.waiting = true
		case !e.Enrolled || e.MTLSAgent || pod.Finished():
		default:
			s, _ := mode.Steering(txn, pod.Key(), steering.Sandbox{IPs: reported})
			p.waiting = s != steering.Steered
		}
		for _, a := range p.addrs {
			// A waiting pod keeps an address another pod claims too.
			if other, ok := byAddr[a.Unmap()]; !ok || !other.waiting {
				byAddr[a.Unmap()] = p
			}
		}
	}
	return byAddr, append([]<-chan struct{}{podsWatch, cniWatch, enrollWatch}, mode.Watch(txn)...)
}

// release releases the enrolled entries of the pods no longer waiting,
// once the connections the l2 mTLS agent held for them are closed, and
// those of no pod once their interface is gone. It returns the pods
// left waiting.
func (h *handover) release(txn statedb.ReadTxn, mode steering.Mode, maps *l2Maps, pods map[netip.Addr]*nodePod) ([]string, error) {
	var held []string
	hold := func(pod string) {
		if !slices.Contains(held, pod) {
			held = append(held, pod)
		}
	}
	if maps == nil {
		for _, p := range pods {
			if p.waiting {
				hold(p.key)
			}
		}
		return held, nil
	}
	entries, err := maps.redirects.Dump()
	if err != nil {
		return nil, err
	}
	releasing := map[*nodePod][]netip.Addr{}
	for addr, e := range entries {
		if e.Kind != bpf.KindEnrolled {
			continue
		}
		p, owned := pods[addr]
		switch {
		case !owned:
			// A pod the API no longer shows, whose sandbox may still run
			// (a forced deletion): released once its interface is gone.
			if _, _, err := h.Pinned.Interface(int(e.Ifindex)); errors.Is(err, os.ErrNotExist) {
				if err := h.releaseAddr(maps, addr, "no pod has it and its interface is gone", ""); err != nil {
					return nil, err
				}
			} else {
				hold(addr.String())
			}
		case p.waiting:
			hold(p.key)
		default:
			releasing[p] = append(releasing[p], addr)
		}
	}
	if len(releasing) == 0 {
		return held, nil
	}
	conns, err := bpf.ProxiedConns(maps.proxied)
	if err != nil {
		return nil, err
	}
	closer, _ := mode.(steering.ConnectionCloser)
	for p, addrs := range releasing {
		var theirs []steering.Conn
		for _, c := range conns {
			if slices.Contains(p.addrs, c.Src.Addr()) {
				theirs = append(theirs, steering.Conn{Local: c.Src, Remote: c.Dst})
			}
		}
		if len(theirs) > 0 {
			// A mode that cannot close connections is a kernel that cannot.
			closed, err := 0, steering.ErrCannotClose
			if closer != nil {
				closed, err = closer.CloseConnections(txn, p.key, theirs)
			}
			switch {
			case errors.Is(err, steering.ErrCannotClose):
				// Kept for good, the pod would be cut off: released, with
				// what is left of those connections.
				h.Log.Warn("Releasing a pod without closing the connections the l2 mTLS agent held: a dead one the pod writes on again will send in clear",
					"pod", p.key, "connections", len(theirs), "error", err)
			case err != nil:
				// Kept, and tried again: passed, they would send in clear.
				h.Log.Warn("Cannot close the connections the l2 mTLS agent held for a pod: it stays with the l2 datapath",
					"pod", p.key, "connections", len(theirs), "error", err)
				hold(p.key)
				continue
			default:
				h.Log.Info("Closed the pod's connections the l2 mTLS agent held", "pod", p.key, "closed", closed, "known", len(theirs))
			}
		}
		for _, addr := range addrs {
			if err := h.releaseAddr(maps, addr, "the "+mode.Name()+" mode steers its pod", p.key); err != nil {
				return nil, err
			}
		}
	}
	return held, nil
}

func (h *handover) releaseAddr(maps *l2Maps, addr netip.Addr, why, pod string) error {
	if err := maps.redirects.Update(addr, bpf.Entry{Kind: bpf.KindLocal, NetnsID: bpf.NoNetns}); err != nil {
		return fmt.Errorf("release %s: %w", addr, err)
	}
	h.Log.Info("Released an address from the l2 datapath", "addr", addr, "pod", pod, "why", why)
	return nil
}

// l2Maps are the l2 mode's pinned maps, checked to be of this version's
// layout.
type l2Maps struct {
	redirects *bpf.RedirectMap
	proxied   *ebpf.Map
}

func openL2Maps(root string) (*l2Maps, error) {
	redirects, err := ebpf.LoadPinnedMap(filepath.Join(root, bpf.MapName), nil)
	if err != nil {
		return nil, err
	}
	proxied, err := ebpf.LoadPinnedMap(filepath.Join(root, bpf.ProxiedMapName), &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		redirects.Close()
		return nil, err
	}
	m := &l2Maps{redirects: bpf.NewRedirectMap(redirects), proxied: proxied}
	if err := bpf.CheckMaps(redirects, proxied); err != nil {
		m.close()
		return nil, err
	}
	return m, nil
}

func (m *l2Maps) close() {
	if m != nil {
		m.redirects.Map().Close()
		m.proxied.Close()
	}
}

// l2Pinned tells whether anything of ours is pinned under root.
func l2Pinned(root string) bool {
	for _, pin := range append(bpf.MapPins(root), filepath.Join(root, linksDir)) {
		if _, err := os.Stat(pin); !errors.Is(err, os.ErrNotExist) {
			return true
		}
	}
	return false
}

// removeL2Pins removes our pins under root: the links, their folder and
// the maps; the root stays. The caller holds root's lock.
func removeL2Pins(log *slog.Logger, root string) error {
	dir := filepath.Join(root, linksDir)
	links, err := os.ReadDir(dir)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	var errs []error
	for _, l := range links {
		pin := filepath.Join(dir, l.Name())
		log.Info("Removing a program left by the l2 mode", "pin", pin)
		errs = append(errs, bpf.Detach(pin))
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	if err := os.Remove(dir); err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, err)
	}
	for _, pin := range bpf.MapPins(root) {
		if err := os.Remove(pin); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		} else if err == nil {
			log.Info("Removed a map left by the l2 mode", "pin", pin)
		}
	}
	return errors.Join(errs...)
}
