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

	"github.com/cilium/hive/cell"

	"github.com/mtlsbridge/mtlsbridge/bpf"
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
	root     string
	linksDir string
	netns    *NodeNetns
	objs     *bpf.Objects
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
	Netns     *NodeNetns
}

func newDatapath(p datapathParams) Datapath {
	lc, log, health, cfg, netns := p.Lifecycle, p.Log, p.Health, p.Config, p.Netns
	switch {
	case inactive(p.Mode):
		return &bpfDatapath{err: ErrInactive}
	case !cfg.EnableRedirect:
		return &bpfDatapath{err: ErrDisabled}
	}
	dp := &bpfDatapath{root: cfg.BPFRoot, netns: netns}
	health = health.NewScope("datapath")
	lc.Append(cell.Hook{
		OnStart: func(ctx cell.HookContext) error {
			// Failing here would stop the agent; a node without BPF keeps
			// the rest of it, and every row says why nothing is steered.
			if dp.err = dp.load(ctx, log); dp.err != nil {
				log.Warn("BPF redirection unavailable", "error", dp.err)
				health.Degraded("BPF datapath unavailable", dp.err)
				return nil
			}
			health.OK("programs loaded, map and links pinned under " + dp.root)
			return nil
		},
		OnStop: func(cell.HookContext) error {
			// Close the descriptors only: the pins keep the map entries and
			// the attached programs for the next agent.
			if dp.objs != nil {
				dp.objs.Close()
			}
			if dp.lock != nil {
				dp.lock.Release()
			}
			return nil
		},
	})
	return dp
}

func (dp *bpfDatapath) load(ctx context.Context, log *slog.Logger) error {
	var err error
	if err := bpf.PrepareRoot(dp.root); err != nil {
		return fmt.Errorf("--bpf-root=%s: %w", dp.root, err)
	}
	// Two agents writing one map would undo each other's entries: wait
	// while another agent (a rolling update's other half) holds it.
	if dp.lock, err = statedir.LockFolder(ctx, dp.root, "BPF root", log); err != nil {
		return fmt.Errorf("--bpf-root=%s: %w", dp.root, err)
	}
	if dp.linksDir, err = bpf.PinDir(dp.root, "links"); err != nil {
		return err
	}
	dp.objs, err = bpf.Load(dp.root)
	return err
}

func (dp *bpfDatapath) Err() error {
	if dp.err != nil {
		return fmt.Errorf("%w: %w", ErrDatapathUnavailable, dp.err)
	}
	if dp.objs == nil {
		return fmt.Errorf("%w: not loaded yet", ErrDatapathUnavailable)
	}
	return nil
}

func (dp *bpfDatapath) UpdateEntry(addr netip.Addr, e bpf.Entry) error {
	if err := dp.Err(); err != nil {
		return err
	}
	return dp.objs.Redirects.Update(addr, e)
}

func (dp *bpfDatapath) DeleteEntry(addr netip.Addr) error {
	if err := dp.Err(); err != nil {
		return err
	}
	return dp.objs.Redirects.Delete(addr)
}

func (dp *bpfDatapath) Entries() (map[netip.Addr]bpf.Entry, error) {
	if err := dp.Err(); err != nil {
		return nil, err
	}
	return dp.objs.Redirects.Dump()
}

func (dp *bpfDatapath) Attach(h bpf.Hook, device string, ifindex int) error {
	if err := dp.Err(); err != nil {
		return err
	}
	return dp.netns.Do(func() error { return dp.objs.Attach(h, dp.pin(device), ifindex) })
}

func (dp *bpfDatapath) Detach(device string) error {
	if err := dp.Err(); err != nil {
		return err
	}
	return bpf.Detach(dp.pin(device))
}

func (dp *bpfDatapath) Attached() (map[string]int, error) {
	if err := dp.Err(); err != nil {
		return nil, err
	}
	entries, err := os.ReadDir(dp.linksDir)
	if err != nil {
		return nil, err
	}
	devices := map[string]int{}
	for _, e := range entries {
		li, _ := bpf.PinnedLink(filepath.Join(dp.linksDir, e.Name()))
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
	return filepath.Join(bpfRoot, "links", strings.ReplaceAll(device, ".", ":"))
}

func unpinName(name string) string { return strings.ReplaceAll(name, ":", ".") }
