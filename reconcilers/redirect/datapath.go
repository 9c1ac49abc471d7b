// SPDX-License-Identifier: Apache-2.0

package redirect

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"

	"github.com/cilium/hive/cell"

	"github.com/mtlsbridge/mtlsbridge/bpf"
	"github.com/mtlsbridge/mtlsbridge/nodenetns"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/steering"
	"github.com/mtlsbridge/mtlsbridge/statedir"
)

// Datapath is what the reconcilers change in the kernel: the entries of
// the redirect map and the programs attached to devices. The cell provides
// the BPF implementation; tests may provide another.
type Datapath interface {
	// Err says why the datapath cannot be used; nil when it can.
	Err() error
	UpdateEntry(addr netip.Addr, e bpf.Entry) error
	// DeleteEntry removes an entry; a missing one is not an error.
	DeleteEntry(addr netip.Addr) error
	Entries() (map[netip.Addr]bpf.Entry, error)
	// Attach puts the hook's program first on the device.
	Attach(h bpf.Hook, device string, ifindex int) error
	// Detach removes what Attach put on the device; nothing there is not
	// an error.
	Detach(device string) error
	// Attached returns the devices that have a program attached by us,
	// with the index of each as its link knows it (0 when the device is
	// gone or the link cannot be read).
	Attached() (map[string]int, error)
}

// bpfDatapath keeps the map and the links pinned under --bpf-root, so that
// they outlive the agent: programs keep steering while it restarts.
type bpfDatapath struct {
	root  string
	netns *nodenetns.Namespace
	// loaded is nil until the start hook has loaded the programs or failed
	// to: the reconcilers' jobs may run before it (the hook waits while
	// another agent holds the BPF root).
	loaded atomic.Pointer[loadedDatapath]
}

// loadedDatapath is what the start hook loaded, or why it could not.
type loadedDatapath struct {
	objs     *bpf.Objects
	linksDir string
	lock     *statedir.Lock
	err      error
}

var _ Datapath = (*bpfDatapath)(nil)

type datapathParams struct {
	cell.In

	Lifecycle cell.Lifecycle
	Log       *slog.Logger
	Health    cell.Health
	Config    Config
	Mode      steering.Config `optional:"true"`
	Netns     *nodenetns.Namespace
}

func newDatapath(p datapathParams) Datapath {
	lc, log, health, cfg, netns := p.Lifecycle, p.Log, p.Health, p.Config, p.Netns
	switch {
	case inactive(p.Mode):
		return failedDatapath(ErrInactive)
	case !cfg.EnableRedirect:
		return failedDatapath(ErrDisabled)
	}
	dp := &bpfDatapath{root: cfg.BPFRoot, netns: netns}
	health = health.NewScope("datapath")
	lc.Append(cell.Hook{
		OnStart: func(ctx cell.HookContext) error {
			l := dp.load(ctx, log)
			dp.loaded.Store(l)
			// Failing here would stop the agent; a node without BPF keeps
			// the rest of it, and every row says why nothing is steered.
			if l.err != nil {
				log.Warn("BPF redirection unavailable", "error", l.err)
				health.Degraded("BPF datapath unavailable", l.err)
				return nil
			}
			health.OK("programs loaded, map and links pinned under " + dp.root)
			return nil
		},
		OnStop: func(cell.HookContext) error {
			// Close the descriptors only: the pins keep the map entries and
			// the attached programs for the next agent.
			if l := dp.loaded.Load(); l != nil {
				if l.objs != nil {
					l.objs.Close()
				}
				if l.lock != nil {
					l.lock.Release()
				}
			}
			return nil
		},
	})
	return dp
}

// failedDatapath is a datapath that is never loaded, for err.
func failedDatapath(err error) *bpfDatapath {
	dp := &bpfDatapath{}
	dp.loaded.Store(&loadedDatapath{err: err})
	return dp
}

func (dp *bpfDatapath) load(ctx context.Context, log *slog.Logger) *loadedDatapath {
	l := &loadedDatapath{}
	if err := bpf.PrepareRoot(dp.root); err != nil {
		l.err = fmt.Errorf("--bpf-root=%s: %w", dp.root, err)
		return l
	}
	// Two agents writing one map would undo each other's entries: wait
	// while another agent (a rolling update's other half) holds it.
	if l.lock, l.err = statedir.LockFolder(ctx, dp.root, "BPF root", log); l.err != nil {
		l.err = fmt.Errorf("--bpf-root=%s: %w", dp.root, l.err)
		return l
	}
	if l.linksDir, l.err = bpf.PinDir(dp.root, linksDir); l.err != nil {
		return l
	}
	l.objs, l.err = bpf.Load(dp.root)
	return l
}

// use returns the loaded datapath, or why it cannot be used.
func (dp *bpfDatapath) use() (*loadedDatapath, error) {
	switch l := dp.loaded.Load(); {
	case l == nil:
		return nil, fmt.Errorf("%w: not loaded yet", ErrDatapathUnavailable)
	case l.err != nil:
		return nil, fmt.Errorf("%w: %w", ErrDatapathUnavailable, l.err)
	default:
		return l, nil
	}
}

func (dp *bpfDatapath) Err() error {
	_, err := dp.use()
	return err
}

func (dp *bpfDatapath) UpdateEntry(addr netip.Addr, e bpf.Entry) error {
	l, err := dp.use()
	if err != nil {
		return err
	}
	return l.objs.Redirects.Update(addr, e)
}

func (dp *bpfDatapath) DeleteEntry(addr netip.Addr) error {
	l, err := dp.use()
	if err != nil {
		return err
	}
	return l.objs.Redirects.Delete(addr)
}

func (dp *bpfDatapath) Entries() (map[netip.Addr]bpf.Entry, error) {
	l, err := dp.use()
	if err != nil {
		return nil, err
	}
	return l.objs.Redirects.Dump()
}

func (dp *bpfDatapath) Attach(h bpf.Hook, device string, ifindex int) error {
	l, err := dp.use()
	if err != nil {
		return err
	}
	return dp.netns.Do(func() error { return l.objs.Attach(h, dp.pin(device), ifindex) })
}

func (dp *bpfDatapath) Detach(device string) error {
	if _, err := dp.use(); err != nil {
		return err
	}
	return bpf.Detach(dp.pin(device))
}

func (dp *bpfDatapath) Attached() (map[string]int, error) {
	l, err := dp.use()
	if err != nil {
		return nil, err
	}
	entries, err := os.ReadDir(l.linksDir)
	if err != nil {
		return nil, err
	}
	devices := map[string]int{}
	for _, e := range entries {
		li, _ := bpf.PinnedLink(filepath.Join(l.linksDir, e.Name()))
		devices[unpinName(e.Name())] = li.Ifindex
	}
	return devices, nil
}

// pin is the link pin of a device.
func (dp *bpfDatapath) pin(device string) string { return LinkPin(dp.root, device) }

// LinkPin is where the link of a device is pinned under the bpffs root.
// bpffs refuses dots in names and interface names cannot hold colons, so
// dots become colons.
func LinkPin(bpfRoot, device string) string {
	return filepath.Join(bpfRoot, linksDir, strings.ReplaceAll(device, ".", ":"))
}

// linksDir is the folder of the link pins under the bpffs root.
const linksDir = "links"

func unpinName(name string) string { return strings.ReplaceAll(name, ":", ".") }
