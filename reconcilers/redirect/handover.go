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
// is handed over pod by pod: an enrolled pod's entries stay until the
// active mode steers it (with no l2 mTLS agent left, its connections are
// dropped meanwhile, never sent in clear), then become local ones, which
// the programs pass; once no pod is left, the links and maps go.

type handoverParams struct {
	cell.In

	Config      Config
	Mode        steering.Config `optional:"true"`
	Modes       steering.Modes
	DB          *statedb.DB
	Pods        statedb.Table[*tables.Pod]
	CNIPods     statedb.Table[*tables.CNIPod]
	Enrollments statedb.Table[*enrollment.Enrollment]
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

// handoverSettle lets the active mode's tables settle (many rows change
// at once) before the map is read again.
const handoverSettle = 100 * time.Millisecond

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
	health.OK("nothing of the l2 mode pinned")
	return nil
}

// handOver releases the pods' entries as the active mode steers them,
// then the pins.
func (h *handover) handOver(ctx context.Context, health cell.Health) error {
	root := h.Config.BPFRoot
	mode, err := h.Modes.Active()
	if err != nil {
		return err
	}
	m, err := ebpf.LoadPinnedMap(filepath.Join(root, bpf.MapName), nil)
	if err != nil {
		// Links without their map (removed by hand), or a map of another
		// layout: nothing to release pod by pod.
		h.Log.Warn("Releasing the l2 mode's pins at once: its map cannot be read", "root", root, "error", err)
		return removeL2Pins(h.Log, root)
	}
	defer m.Close()
	redirects := bpf.NewRedirectMap(m)
	if !reconcilers.WaitInitialized(ctx, health, h.DB, append([]statedb.TableMeta{h.Pods, h.CNIPods, h.Enrollments}, mode.Tables()...)...) {
		return ctx.Err()
	}
	ws := statedb.NewWatchSet()
	for {
		txn := h.DB.ReadTxn()
		owners, waiting, watch := h.pods(txn, mode)
		entries, err := redirects.Dump()
		if err != nil {
			return err
		}
		held := 0
		for addr, e := range entries {
			switch {
			case e.Kind != bpf.KindEnrolled:
			case waiting[addr]:
				held++
			default:
				if err := redirects.Update(addr, bpf.Entry{Kind: bpf.KindLocal, NetnsID: bpf.NoNetns}); err != nil {
					return fmt.Errorf("release %s: %w", addr, err)
				}
				h.Log.Info("Released an address from the l2 datapath: the active mode steers its pod, or no enrolled pod has it",
					"addr", addr, "pod", owners[addr], "mode", mode.Name())
			}
		}
		if held == 0 {
			return removeL2Pins(h.Log, root)
		}
		health.OK(fmt.Sprintf("%d addresses of enrolled pods left with the l2 datapath until the %s mode steers them", held, mode.Name()))
		ws.Clear()
		ws.Add(watch...)
		if _, err := ws.Wait(ctx, handoverSettle); err != nil {
			return err // stopping
		}
	}
}

// pods tells, of this node's pods, who has each address, and which
// addresses are of enrolled pods the active mode does not steer yet.
func (h *handover) pods(txn statedb.ReadTxn, mode steering.Mode) (owners map[netip.Addr]string, waiting map[netip.Addr]bool, watch []<-chan struct{}) {
	owners, waiting = map[netip.Addr]string{}, map[netip.Addr]bool{}
	pods, podsWatch := h.Pods.ListWatch(txn, tables.PodsOfThisNode())
	_, cniWatch := h.CNIPods.AllWatch(txn)
	_, enrollWatch := h.Enrollments.AllWatch(txn)
	for pod := range pods {
		// The map holds the addresses the API showed, a new sandbox's
		// may be only in its CNI report.
		addrs := append(tables.PodAddrs(txn, h.CNIPods, pod), pod.IPs...)
		for _, a := range addrs {
			owners[a.Unmap()] = pod.Key()
		}
		e, _, ok := h.Enrollments.Get(txn, enrollment.ByKey(pod.Key()))
		if !ok || !e.Enrolled || e.MTLSAgent || pod.Finished() {
			continue
		}
		if s, _ := mode.Steering(txn, pod.Key(), steering.Sandbox{IPs: addrs}); s == steering.Steered {
			continue
		}
		for _, a := range addrs {
			waiting[a.Unmap()] = true
		}
	}
	return owners, waiting, append([]<-chan struct{}{podsWatch, cniWatch, enrollWatch}, mode.Watch(txn)...)
}

// l2Pinned tells whether anything of ours is pinned under root.
func l2Pinned(root string) bool {
	for _, pin := range []string{filepath.Join(root, bpf.MapName), filepath.Join(root, "links")} {
		if _, err := os.Stat(pin); !errors.Is(err, os.ErrNotExist) {
			return true
		}
	}
	return false
}

// removeL2Pins removes our pins under root: the links, their folder and
// the maps; the root stays. The caller holds root's lock.
func removeL2Pins(log *slog.Logger, root string) error {
	links, err := os.ReadDir(filepath.Join(root, "links"))
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	var errs []error
	for _, l := range links {
		pin := filepath.Join(root, "links", l.Name())
		log.Info("Removing a program left by the l2 mode", "pin", pin)
		errs = append(errs, bpf.Detach(pin))
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	if err := os.Remove(filepath.Join(root, "links")); err != nil && !errors.Is(err, os.ErrNotExist) {
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
