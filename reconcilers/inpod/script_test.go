// SPDX-License-Identifier: Apache-2.0

package inpod_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
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
	"istio.io/istio/pkg/zdsapi"

	"github.com/mtlsbridge/mtlsbridge/internal/manifesttest"
	"github.com/mtlsbridge/mtlsbridge/metrics"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/enrollment"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/inpod"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/readiness"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/steering"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/steering/steeringtest"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/workload"
	"github.com/mtlsbridge/mtlsbridge/tables"
	"github.com/mtlsbridge/mtlsbridge/tables/ingest"
	"github.com/mtlsbridge/mtlsbridge/zds"
)

// TestScript runs testdata/*.txtar: the in-pod mode's derivation,
// reconciler and ZDS server, with readiness and the Workloads, against
// pods' namespaces in memory and real ZDS clients (zds.Client, with
// ztunnel's fatal cases) on the real socket. No privileges needed: the
// namespaces handed over are the test's own.
func TestScript(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	scripttest.Test(t, ctx, newEngine, nil, "testdata/*.txtar")
}

// TestScriptModeSwitch runs testdata/modeswitch/*.txtar, the in-pod
// redirection left behind in another mode, with less time than the
// periodic prune takes (a minute): what must go once the l2 mode steers
// a pod goes through the prune that follows its answers, not the next
// periodic one.
func TestScriptModeSwitch(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), inpod.PruneInterval/2)
	t.Cleanup(cancel)
	scripttest.Test(t, ctx, newEngine, nil, "testdata/modeswitch/*.txtar")
}

func newEngine(t testing.TB, args []string) *script.Engine {
	// Short: UNIX socket paths are limited to 108 bytes.
	dir, err := os.MkdirTemp("", "inpod-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	socket := filepath.Join(dir, "ztunnel.sock")
	target := &fakeTarget{namespaces: map[string][]netip.Addr{}, ids: map[string]uint64{}, aliases: map[string]string{}, rules: map[string]bool{}, altered: map[string]bool{}, emptied: map[string]bool{}, tried: map[string]bool{}}
	var modes steering.Modes
	var db *statedb.DB
	l2 := steeringtest.New(steering.ModeL2)
	h := hive.New(
		cell.SimpleHealthCell, job.Cell, statedb.Cell,
		metrics.Cell, tables.Cell, ingest.Cell, enrollment.Cell, steering.Cell,
		readiness.Cell, workload.Cell,
		cell.Module("inpod-test", "In-pod mode on namespaces in memory",
			cell.Provide(func() inpod.Target { return target }, inpod.TableReportsForTests),
			// The node's probe SNAT is read again only when a script asks
			// (inpod/prune).
			cell.Provide(func() inpod.ProbeCheckInterval { return inpod.ProbeCheckInterval(time.Hour) }),
			inpod.Core,
		),
		// The l2 mode's datapath has tests of its own; in these, l2 is a
		// mode that steers what l2/steer says.
		cell.Provide(l2.Out),
		cell.Invoke(func(m steering.Modes, d *statedb.DB) { modes, db = m, d }),
		cell.Provide(func(h *cell.SimpleHealth) hive.ScriptCmdOut {
			return hive.NewScriptCmd("health", cell.SimpleHealthCmd(h))
		}),
	)
	cmds := target.commands()
	zt := &ztunnels{t: t, socket: socket, running: map[string]*ztunnel{}}
	maps.Insert(cmds, maps.All(zt.commands()))
	maps.Insert(cmds, maps.All(l2Commands(l2)))
	cmds["steering/ask"] = script.Command(
		script.CmdUsage{Summary: "print the active mode's answer for a pod and addresses (of the sandbox in netns, as the CNI route asks)",
			Args: "[--netns=PATH] pod addr..."},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			var netns string
			if len(args) > 0 {
				if path, ok := strings.CutPrefix(args[0], "--netns="); ok {
					netns, args = path, args[1:]
				}
			}
			if len(args) < 1 {
				return nil, script.ErrUsage
			}
			addrs, err := parseAddrs(args[1:])
			if err != nil {
				return nil, err
			}
			mode, err := modes.Active()
			if err != nil {
				return nil, err
			}
			state, detail := mode.Steering(db.ReadTxn(), args[0], steering.Sandbox{IPs: addrs, Netns: netns})
			return func(*script.State) (string, string, error) { return fmt.Sprintf("%s: %s\n", state, detail), "", nil }, nil
		})
	cmds["steering/bypass"] = script.Command(
		script.CmdUsage{Summary: "run the active mode's bypass check for pods", Args: "pod..."},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			mode, err := modes.Active()
			if err != nil {
				return nil, err
			}
			bc := mode.(steering.BypassChecker)
			var targets []steering.Target
			for _, p := range args {
				targets = append(targets, steering.Target{Pod: p})
			}
			gaps := bc.CheckBypass(db.ReadTxn(), targets)
			var b strings.Builder
			for _, p := range args {
				fmt.Fprintf(&b, "%s: %s\n", p, strings.Join(gaps[p], "; "))
			}
			return func(*script.State) (string, string, error) { return b.String(), "", nil }, nil
		})
	engine := manifesttest.NewEngine(t, h, t.TempDir(), append([]string{"--node-name=node-a",
		"--redirect-mode=inpod", "--zds-socket=" + socket, "--probe-snat"}, args...), cmds)
	// Before the hive stops (cleanups run last first).
	t.Cleanup(zt.stopAll)
	return engine
}

// l2Commands drive the stand-in l2 mode of these tests.
func l2Commands(m *steeringtest.Mode) map[string]script.Cmd {
	return map[string]script.Cmd{
		"l2/steer": script.Command(
			script.CmdUsage{Summary: "make the l2 mode steer the pods", Args: "pod..."},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				m.Steer(args...)
				return nil, nil
			}),
		"l2/disable": script.Command(
			script.CmdUsage{Summary: "switch the l2 mode off (--enable-redirect=false)"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				m.Disable()
				return nil, nil
			}),
	}
}

// fakeTarget is pods' namespaces in memory: their addresses, and whether
// the redirection is in them. Open hands the test's own namespace, a real
// one, as ztunnel checks. A path may be made to name another path's
// namespace (a /proc/PID/ns/net path whose PID was reused).
type fakeTarget struct {
	mu         sync.Mutex
	namespaces map[string][]netip.Addr
	ids        map[string]uint64 // never reused (the kernel reuses those of namespaces gone)
	lastID     uint64
	aliases    map[string]string
	rules      map[string]bool
	altered    map[string]bool
	// emptied are the namespaces whose connections were all closed,
	// tried those whose connections closing was tried for; closeErr is
	// what closing answers.
	emptied, tried map[string]bool
	closeErr       error
	// probes are the addresses the node SNATs its connections to; asked
	// those of the last check, if one came since node/probe-snat-asked.
	probes, asked []netip.Addr
	wasAsked      bool
}

// resolve returns the path under which the namespace path names is kept.
func (f *fakeTarget) resolve(path string) string {
	if to, ok := f.aliases[path]; ok {
		return to
	}
	return path
}

var _ inpod.Target = (*fakeTarget)(nil)

func (f *fakeTarget) Apply(r *inpod.Redirection) (inpod.NetnsID, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	path := f.resolve(r.Netns)
	addrs, ok := f.namespaces[path]
	if !ok {
		return inpod.NetnsID{}, fmt.Errorf("open %s: %w", r.Netns, os.ErrNotExist)
	}
	for _, ip := range r.IPs {
		if !slices.Contains(addrs, ip) {
			return inpod.NetnsID{}, fmt.Errorf("%w: %s does not hold %s", inpod.ErrWrongNetns, r.Netns, ip)
		}
	}
	f.rules[path] = true
	delete(f.altered, path)
	return inpod.NetnsID{Ino: f.ids[path]}, nil
}

func (f *fakeTarget) Identify(path string) (inpod.NetnsID, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	id, ok := f.ids[f.resolve(path)]
	if !ok {
		return inpod.NetnsID{}, fmt.Errorf("stat %s: %w", path, os.ErrNotExist)
	}
	return inpod.NetnsID{Ino: id}, nil
}

func (f *fakeTarget) Remove(path string, id inpod.NetnsID) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if path = f.resolve(path); f.ids[path] == id.Ino {
		delete(f.rules, path)
	}
	return nil
}

func (f *fakeTarget) Present(path string, id inpod.NetnsID) (bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	path = f.resolve(path)
	return f.ids[path] == id.Ino && f.rules[path], nil
}

func (f *fakeTarget) Check(path string, ips []netip.Addr) ([]string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	path = f.resolve(path)
	if _, ok := f.namespaces[path]; !ok {
		return nil, fmt.Errorf("open %s: %w", path, os.ErrNotExist)
	}
	switch {
	case !f.rules[path]:
		return []string{inpod.GapTableMissing}, nil
	case f.altered[path]:
		return []string{inpod.GapTableAltered + ": chain output-nat has 6 rules, want 7"}, nil
	}
	return nil, nil
}

func (f *fakeTarget) Open(path string, ips []netip.Addr) (*os.File, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.namespaces[f.resolve(path)]; !ok {
		return nil, fmt.Errorf("open %s: %w", path, os.ErrNotExist)
	}
	return os.Open("/proc/self/ns/net")
}

// CloseConnections: namespaces in memory hold no sockets.
func (f *fakeTarget) CloseConnections(path string, _ []netip.Addr, _ []steering.Conn) (int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.namespaces[f.resolve(path)]; !ok {
		return 0, fmt.Errorf("open %s: %w", path, os.ErrNotExist)
	}
	return 0, nil
}

func (f *fakeTarget) CloseAll(path string, _ inpod.NetnsID) (int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.namespaces[f.resolve(path)]; !ok {
		return 0, nil
	}
	f.tried[f.resolve(path)] = true
	if f.closeErr != nil {
		return 0, f.closeErr
	}
	f.emptied[f.resolve(path)] = true
	return 0, nil
}

func (f *fakeTarget) Namespaces(dir string) ([]inpod.Namespace, map[string]error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var found []inpod.Namespace
	for path, addrs := range f.namespaces {
		if filepath.Dir(path) == dir {
			found = append(found, inpod.Namespace{Path: path, ID: inpod.NetnsID{Ino: f.ids[path]}, IPs: addrs})
		}
	}
	return found, nil
}

func (f *fakeTarget) WriteProbeSNAT(ips []netip.Addr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.probes = slices.Clone(ips)
	return nil
}

func (f *fakeTarget) CheckProbeSNAT(ips []netip.Addr) ([]string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.asked, f.wasAsked = slices.Clone(ips), true
	if !slices.Equal(f.probes, ips) {
		return []string{inpod.GapProbesAltered}, nil
	}
	return nil, nil
}

func (f *fakeTarget) commands() map[string]script.Cmd {
	return map[string]script.Cmd{
		"netns/add": script.Command(
			script.CmdUsage{Summary: "a pod's network namespace at PATH, holding addresses", Args: "path addr..."},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) < 1 {
					return nil, script.ErrUsage
				}
				addrs, err := parseAddrs(args[1:])
				if err != nil {
					return nil, err
				}
				f.mu.Lock()
				defer f.mu.Unlock()
				f.namespaces[args[0]] = addrs
				if _, ok := f.ids[args[0]]; !ok {
					f.lastID++
					f.ids[args[0]] = f.lastID
				}
				return nil, nil
			}),
		"netns/del": f.pathCommand("the namespace at PATH goes (the sandbox died)", func(path string) {
			delete(f.namespaces, path)
			delete(f.ids, path)
			delete(f.rules, path)
		}),
		"netns/alias": script.Command(
			script.CmdUsage{Summary: "PATH names the namespace at OTHER now (its PID was reused)", Args: "path other"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) != 2 {
					return nil, script.ErrUsage
				}
				f.mu.Lock()
				defer f.mu.Unlock()
				f.aliases[args[0]] = args[1]
				return nil, nil
			}),
		"netns/alter": f.pathCommand("someone deletes a rule of the redirection in PATH", func(path string) {
			f.altered[path] = true
		}),
		"netns/put-rules": f.pathCommand("the redirection is in PATH (left by an earlier agent)", func(path string) {
			f.rules[path] = true
		}),
		"node/probe-snat": script.Command(
			script.CmdUsage{Summary: "list the addresses the node SNATs its connections to (the kubelet's probes)"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				f.mu.Lock()
				defer f.mu.Unlock()
				out := ""
				for _, ip := range f.probes {
					out += ip.String() + "\n"
				}
				return func(*script.State) (string, string, error) { return out, "", nil }, nil
			}),
		"node/probe-snat-asked": script.Command(
			script.CmdUsage{Summary: "print the addresses the last check of the node's probe SNAT asked for, if one came since the last time this printed"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				f.mu.Lock()
				defer f.mu.Unlock()
				out := ""
				if f.wasAsked {
					out = fmt.Sprintf("asked: %v\n", f.asked)
				}
				f.wasAsked = false
				return func(*script.State) (string, string, error) { return out, "", nil }, nil
			}),
		"node/put-probe-snat": script.Command(
			script.CmdUsage{Summary: "the node's table holds the addresses (left by an earlier agent; none: someone emptied it)", Args: "[addr...]"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				addrs, err := parseAddrs(args)
				if err != nil {
					return nil, err
				}
				f.mu.Lock()
				defer f.mu.Unlock()
				f.probes = addrs
				return nil, nil
			}),
		"netns/rules":       f.listCommand("list the namespaces holding the redirection", f.rules),
		"netns/emptied":     f.listCommand("list the namespaces whose connections were all closed", f.emptied),
		"netns/close-tried": f.listCommand("list the namespaces whose connections closing was tried for", f.tried),
		"netns/close-fails": script.Command(
			script.CmdUsage{Summary: "closing connections fails from now on: error (retried), cannot (no SOCK_DESTROY), or no", Args: "error|cannot|no"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) != 1 {
					return nil, script.ErrUsage
				}
				f.mu.Lock()
				defer f.mu.Unlock()
				switch args[0] {
				case "error":
					f.closeErr = errors.New("test: cannot close")
				case "cannot":
					f.closeErr = steering.ErrCannotClose
				case "no":
					f.closeErr = nil
				default:
					return nil, script.ErrUsage
				}
				return nil, nil
			}),
	}
}

func (f *fakeTarget) listCommand(summary string, set map[string]bool) script.Cmd {
	return script.Command(script.CmdUsage{Summary: summary},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			f.mu.Lock()
			defer f.mu.Unlock()
			out := ""
			for _, p := range slices.Sorted(maps.Keys(set)) {
				out += p + "\n"
			}
			return func(*script.State) (string, string, error) { return out, "", nil }, nil
		})
}

// ztunnels are ZDS clients of the script, by name.
type ztunnels struct {
	t       testing.TB
	socket  string
	mu      sync.Mutex
	running map[string]*ztunnel
}

// ztunnel is a zds.Client serving pods in memory, as ztunnel would.
type ztunnel struct {
	cancel context.CancelFunc
	done   chan error

	mu     sync.Mutex
	served map[string]string
	refuse map[string]string
}

func (z *ztunnel) Add(uid string, info *zdsapi.WorkloadInfo, netns *os.File) error {
	netns.Close()
	z.mu.Lock()
	defer z.mu.Unlock()
	if r := z.refuse[uid]; r != "" {
		return fmt.Errorf("%s", r)
	}
	z.served[uid] = fmt.Sprintf("%s/%s sa=%s", info.GetNamespace(), info.GetName(), info.GetServiceAccount())
	return nil
}

func (z *ztunnel) Del(uid string) {
	z.mu.Lock()
	defer z.mu.Unlock()
	delete(z.served, uid)
}

func (z *ztunnel) Reconcile(keep map[string]bool) {
	z.mu.Lock()
	defer z.mu.Unlock()
	for uid := range z.served {
		if !keep[uid] {
			delete(z.served, uid)
		}
	}
}

func (zs *ztunnels) stop(name string) error {
	zs.mu.Lock()
	z := zs.running[name]
	delete(zs.running, name)
	zs.mu.Unlock()
	if z == nil {
		return fmt.Errorf("no ztunnel %s", name)
	}
	z.cancel()
	if err := <-z.done; err != nil {
		return fmt.Errorf("ztunnel %s stopped with %w (the node agent broke the protocol)", name, err)
	}
	return nil
}

func (zs *ztunnels) stopAll() {
	zs.mu.Lock()
	names := slices.Collect(maps.Keys(zs.running))
	zs.mu.Unlock()
	for _, n := range names {
		if err := zs.stop(n); err != nil {
			zs.t.Error(err)
		}
	}
}

func (zs *ztunnels) get(name string) (*ztunnel, error) {
	zs.mu.Lock()
	defer zs.mu.Unlock()
	z := zs.running[name]
	if z == nil {
		return nil, fmt.Errorf("no ztunnel %s", name)
	}
	return z, nil
}

func (zs *ztunnels) commands() map[string]script.Cmd {
	return map[string]script.Cmd{
		"ztunnel/start": script.Command(
			script.CmdUsage{Summary: "start a ZDS client named NAME", Args: "name"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) != 1 {
					return nil, script.ErrUsage
				}
				z := &ztunnel{done: make(chan error, 1), served: map[string]string{}, refuse: map[string]string{}}
				ctx, cancel := context.WithCancel(context.Background())
				z.cancel = cancel
				c := &zds.Client{Path: zs.socket, Handler: z, Log: slog.New(slog.DiscardHandler), MaxBackoff: 20 * time.Millisecond}
				go func() { z.done <- c.Run(ctx) }()
				zs.mu.Lock()
				zs.running[args[0]] = z
				zs.mu.Unlock()
				return nil, nil
			}),
		"ztunnel/stop": script.Command(
			script.CmdUsage{Summary: "stop the ZDS client NAME; fails if it met a fatal protocol error", Args: "name"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				return nil, zs.stop(args[0])
			}),
		"ztunnel/serving": script.Command(
			script.CmdUsage{Summary: "print the pods the ZDS client NAME serves: uid namespace/name sa=", Args: "name"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				z, err := zs.get(args[0])
				if err != nil {
					return nil, err
				}
				z.mu.Lock()
				defer z.mu.Unlock()
				out := ""
				for _, uid := range slices.Sorted(maps.Keys(z.served)) {
					out += uid + " " + z.served[uid] + "\n"
				}
				return func(*script.State) (string, string, error) { return out, "", nil }, nil
			}),
		"ztunnel/refuse": script.Command(
			script.CmdUsage{Summary: "the ZDS client NAME refuses adds of UID with REASON (- to accept again)", Args: "name uid reason"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) != 3 {
					return nil, script.ErrUsage
				}
				z, err := zs.get(args[0])
				if err != nil {
					return nil, err
				}
				z.mu.Lock()
				defer z.mu.Unlock()
				if args[2] == "-" {
					delete(z.refuse, args[1])
				} else {
					z.refuse[args[1]] = args[2]
				}
				return nil, nil
			}),
	}
}

// pathCommand is a command on one namespace path: change runs under the
// target's lock.
func (f *fakeTarget) pathCommand(summary string, change func(path string)) script.Cmd {
	return script.Command(script.CmdUsage{Summary: summary, Args: "path"},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			if len(args) != 1 {
				return nil, script.ErrUsage
			}
			f.mu.Lock()
			defer f.mu.Unlock()
			change(args[0])
			return nil, nil
		})
}

// parseAddrs parses a command's address arguments.
func parseAddrs(args []string) ([]netip.Addr, error) {
	addrs := make([]netip.Addr, 0, len(args))
	for _, a := range args {
		ip, err := netip.ParseAddr(a)
		if err != nil {
			return nil, err
		}
		addrs = append(addrs, ip)
	}
	return addrs, nil
}
