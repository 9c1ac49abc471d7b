// SPDX-License-Identifier: Apache-2.0

package redirect_test

import (
	"context"
	"fmt"
	"maps"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/hive/script"
	"github.com/cilium/hive/script/scripttest"
	"github.com/cilium/statedb"

	"github.com/mtlsbridge/mtlsbridge/api"
	"github.com/mtlsbridge/mtlsbridge/bpf"
	"github.com/mtlsbridge/mtlsbridge/internal/manifesttest"
	"github.com/mtlsbridge/mtlsbridge/metrics"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/enrollment"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/readiness"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/redirect"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/workload"
	"github.com/mtlsbridge/mtlsbridge/tables"
	"github.com/mtlsbridge/mtlsbridge/tables/ingest"
)

// TestScript runs testdata/*.txtar: the derivation and the reconcilers
// against a fake kernel (interfaces, map and attachments in memory),
// driven by manifest files and kernel/* commands. No privileges needed.
func TestScript(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	scripttest.Test(t, ctx, newEngine, nil, "testdata/*.txtar")
}

func newEngine(t testing.TB, args []string) *script.Engine {
	k := &fakeKernel{
		entries:  map[netip.Addr]bpf.Entry{},
		attached: map[string]bpf.Hook{},
		pods:     map[netip.Addr]redirect.PodInterface{},
		devices:  map[string]int{"lo": 1},
		changed:  make(chan struct{}),
	}
	var checks []api.Check
	h := hive.New(
		cell.SimpleHealthCell, job.Cell, statedb.Cell,
		metrics.Cell, tables.Cell, ingest.Cell, enrollment.Cell,
		// What xDS tells the mTLS agent follows the datapath (HBONE).
		readiness.Cell, workload.Cell,
		cell.Module("redirect-test", "Redirect cell on a fake kernel",
			cell.Provide(
				func() redirect.Datapath { return k },
				func() redirect.Interfaces { return k },
			),
			redirect.Core,
		),
		cell.Invoke(func(in struct {
			cell.In
			Checks []api.Check `group:"readiness-checks"`
		}) {
			checks = in.Checks
		}),
	)
	cmds := k.commands()
	cmds["warnings"] = script.Command(
		script.CmdUsage{Summary: "print the failing readiness checks of /healthz, one per line: NAME: ERROR"},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			return func(*script.State) (stdout, stderr string, err error) {
				for _, c := range checks {
					if err := c.Err(); err != nil {
						stdout += c.Name + ": " + err.Error() + "\n"
					}
				}
				return stdout, "", nil
			}, nil
		})
	return manifesttest.NewEngine(t, h, t.TempDir(), append([]string{"--node-name=node-a"}, args...), cmds)
}

// fakeKernel is a Datapath and Interfaces in memory.
type fakeKernel struct {
	mu       sync.Mutex
	entries  map[netip.Addr]bpf.Entry
	attached map[string]bpf.Hook
	pods     map[netip.Addr]redirect.PodInterface
	devices  map[string]int
	uplinks  []string // devices that look like uplinks
	changed  chan struct{}
	broken   error
	scanErr  error // every Scan fails
}

var (
	_ redirect.Datapath   = (*fakeKernel)(nil)
	_ redirect.Interfaces = (*fakeKernel)(nil)
)

func (k *fakeKernel) Err() error {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.broken
}

func (k *fakeKernel) UpdateEntry(addr netip.Addr, e bpf.Entry) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.broken != nil {
		return k.broken
	}
	k.entries[addr] = e
	return nil
}

func (k *fakeKernel) DeleteEntry(addr netip.Addr) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.broken != nil {
		return k.broken
	}
	delete(k.entries, addr)
	return nil
}

func (k *fakeKernel) Entries() (map[netip.Addr]bpf.Entry, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	return maps.Clone(k.entries), k.broken
}

func (k *fakeKernel) Attach(h bpf.Hook, device string, ifindex int) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.broken != nil {
		return k.broken
	}
	if k.devices[device] != ifindex {
		return fmt.Errorf("no device %s with index %d", device, ifindex)
	}
	k.attached[device] = h
	return nil
}

func (k *fakeKernel) Detach(device string) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	delete(k.attached, device)
	return k.broken
}

func (k *fakeKernel) Attached() (map[string]int, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	attached := map[string]int{}
	for device := range k.attached {
		attached[device] = k.devices[device]
	}
	return attached, k.broken
}

func (k *fakeKernel) Scan() (redirect.Scan, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.scanErr != nil {
		// As netlink's LinkList when a dump is interrupted for good.
		return redirect.Scan{Pods: map[netip.Addr]redirect.PodInterface{}, Devices: map[string]int{}}, k.scanErr
	}
	return redirect.Scan{Pods: maps.Clone(k.pods), Devices: maps.Clone(k.devices), Uplinks: slices.Clone(k.uplinks), UplinksFound: true}, nil
}

func (k *fakeKernel) Changed() <-chan struct{} {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.changed
}

// change runs fn under the lock and tells the derivation.
func (k *fakeKernel) change(fn func()) {
	k.mu.Lock()
	defer k.mu.Unlock()
	fn()
	close(k.changed)
	k.changed = make(chan struct{})
}

func (k *fakeKernel) commands() map[string]script.Cmd {
	return map[string]script.Cmd{
		"kernel/veth": script.Command(
			script.CmdUsage{Summary: "add a pod's veth pair: host side NAME with INDEX, peer MAC and addresses, netns id NSID", Args: "name index mac nsid addr..."},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) < 5 {
					return nil, script.ErrUsage
				}
				index, err1 := strconv.Atoi(args[1])
				mac, err2 := net.ParseMAC(args[2])
				nsid, err3 := strconv.Atoi(args[3])
				if err := errorsJoin(err1, err2, err3); err != nil {
					return nil, err
				}
				iface := redirect.PodInterface{Name: args[0], Index: index, MAC: mac, NetnsID: int32(nsid)}
				var addrs []netip.Addr
				for _, a := range args[4:] {
					addr, err := netip.ParseAddr(a)
					if err != nil {
						return nil, err
					}
					addrs = append(addrs, addr)
				}
				k.change(func() {
					k.devices[iface.Name] = index
					for _, addr := range addrs {
						k.pods[addr] = iface
					}
				})
				return nil, nil
			}),
		"kernel/device": script.Command(
			script.CmdUsage{Summary: "add or change a device NAME with INDEX; uplink: it looks like an uplink", Args: "name index [uplink]"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) != 2 && (len(args) != 3 || args[2] != "uplink") {
					return nil, script.ErrUsage
				}
				index, err := strconv.Atoi(args[1])
				if err != nil {
					return nil, err
				}
				k.change(func() {
					k.devices[args[0]] = index
					k.uplinks = slices.DeleteFunc(k.uplinks, func(name string) bool { return name == args[0] })
					if len(args) == 3 {
						k.uplinks = append(k.uplinks, args[0])
					}
				})
				return nil, nil
			}),
		"kernel/del": script.Command(
			script.CmdUsage{Summary: "delete a device (a veth pair with its addresses)", Args: "name"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) != 1 {
					return nil, script.ErrUsage
				}
				k.change(func() {
					delete(k.devices, args[0])
					k.uplinks = slices.DeleteFunc(k.uplinks, func(name string) bool { return name == args[0] })
					maps.DeleteFunc(k.pods, func(_ netip.Addr, i redirect.PodInterface) bool { return i.Name == args[0] })
				})
				return nil, nil
			}),
		"kernel/put": script.Command(
			script.CmdUsage{Summary: "write a map entry of KIND (local or enrolled) directly, as a previous agent left it, with the pod's interface INDEX", Args: "addr kind [index]"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) != 2 && len(args) != 3 {
					return nil, script.ErrUsage
				}
				addr, err := netip.ParseAddr(args[0])
				if err != nil {
					return nil, err
				}
				kind := map[string]bpf.Kind{"local": bpf.KindLocal, "enrolled": bpf.KindEnrolled}[args[1]]
				if kind == 0 {
					return nil, fmt.Errorf("kind %q: want local or enrolled", args[1])
				}
				e := bpf.Entry{Kind: kind, NetnsID: bpf.NoNetns}
				if len(args) == 3 {
					index, err := strconv.Atoi(args[2])
					if err != nil {
						return nil, err
					}
					e.Ifindex = uint32(index)
				}
				k.change(func() { k.entries[addr] = e })
				return nil, nil
			}),
		"kernel/attach": script.Command(
			script.CmdUsage{Summary: "attach HOOK to DEVICE directly, as a previous agent left it", Args: "device hook"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) != 2 {
					return nil, script.ErrUsage
				}
				k.change(func() { k.attached[args[0]] = bpf.Hook(args[1]) })
				return nil, nil
			}),
		"kernel/scan-fail": script.Command(
			script.CmdUsage{Summary: "make interface scans find nothing and fail with MESSAGE, or work again without", Args: "[message]"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				k.change(func() {
					k.scanErr = nil
					if len(args) > 0 {
						k.scanErr = fmt.Errorf("%s", strings.Join(args, " "))
					}
				})
				return nil, nil
			}),
		"kernel/break": script.Command(
			script.CmdUsage{Summary: "make every map and attach operation fail with MESSAGE, or succeed again without", Args: "[message]"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				k.mu.Lock()
				defer k.mu.Unlock()
				k.broken = nil
				if len(args) > 0 {
					k.broken = fmt.Errorf("%s", strings.Join(args, " "))
				}
				return nil, nil
			}),
	}
}

func errorsJoin(errs ...error) error {
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}
