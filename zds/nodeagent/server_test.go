// SPDX-License-Identifier: Apache-2.0

package nodeagent_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/statedb"
	"istio.io/istio/pkg/zdsapi"

	"github.com/mtlsbridge/mtlsbridge/zds"
	"github.com/mtlsbridge/mtlsbridge/zds/nodeagent"
)

// waitTimeout bounds every wait of these tests.
const waitTimeout = 10 * time.Second

// ztunnel is a zds.Client with a recording handler: what a ztunnel would
// serve. It fails the test if the server ever sends what ztunnel finds
// fatal.
type ztunnel struct {
	t      *testing.T
	cancel context.CancelFunc
	done   chan error

	mu     sync.Mutex
	served map[string]string // uid -> "namespace/name sa=..."
	events []string
	fail   map[string]error // uid -> refusal
	// stall: the handler blocks until released (a ztunnel that does not
	// answer).
	stall chan struct{}
}

func startZtunnel(t *testing.T, path string) *ztunnel {
	z := &ztunnel{t: t, done: make(chan error, 1), served: map[string]string{}, fail: map[string]error{}}
	ctx, cancel := context.WithCancel(context.Background())
	z.cancel = cancel
	c := &zds.Client{Path: path, Handler: z, Log: slog.New(slog.DiscardHandler), MaxBackoff: 20 * time.Millisecond}
	go func() { z.done <- c.Run(ctx) }()
	t.Cleanup(z.stop)
	return z
}

func (z *ztunnel) stop() {
	z.cancel()
	if err := <-z.done; err != nil {
		z.t.Errorf("ztunnel: %v", err) // ErrProtocol: the server broke the protocol
	}
	z.done <- nil
}

func (z *ztunnel) Add(uid string, info *zdsapi.WorkloadInfo, netns *os.File) error {
	defer netns.Close()
	if z.stall != nil {
		<-z.stall
	}
	z.mu.Lock()
	defer z.mu.Unlock()
	z.events = append(z.events, "add "+uid)
	if err := z.fail[uid]; err != nil {
		return err
	}
	z.served[uid] = fmt.Sprintf("%s/%s sa=%s", info.GetNamespace(), info.GetName(), info.GetServiceAccount())
	return nil
}

func (z *ztunnel) Del(uid string) {
	z.mu.Lock()
	defer z.mu.Unlock()
	z.events = append(z.events, "del "+uid)
	delete(z.served, uid)
}

func (z *ztunnel) Reconcile(keep map[string]bool) {
	z.mu.Lock()
	defer z.mu.Unlock()
	z.events = append(z.events, "snapshot")
	for uid := range z.served {
		if !keep[uid] {
			delete(z.served, uid)
		}
	}
}

func (z *ztunnel) serving() []string {
	z.mu.Lock()
	defer z.mu.Unlock()
	var out []string
	for uid, w := range z.served {
		out = append(out, uid+" "+w)
	}
	slices.Sort(out)
	return out
}

type fixture struct {
	t     *testing.T
	db    *statedb.DB
	rows  statedb.RWTable[*nodeagent.Workload]
	conns statedb.RWTable[*nodeagent.Connection]
	path  string
	// netns is a real namespace, the test's own; rows naming "gone" have
	// none.
	netns string
}

// newFixture gives tables and a server on the socket.
func newFixture(t *testing.T, timeout time.Duration) *fixture {
	f := newTables(t)
	t.Cleanup(f.serve(timeout))
	return f
}

// newTables gives the tables, no server.
func newTables(t *testing.T) *fixture {
	f := &fixture{t: t, db: statedb.New(), path: filepath.Join(t.TempDir(), "ztunnel.sock"), netns: "/proc/self/ns/net"}
	var err error
	if f.rows, err = nodeagent.NewWorkloadsTable(f.db); err != nil {
		t.Fatal(err)
	}
	if f.conns, err = nodeagent.NewConnectionsTable(f.db); err != nil {
		t.Fatal(err)
	}
	return f
}

// serve runs a server on the fixture's socket and returns its stop.
func (f *fixture) serve(timeout time.Duration) (stop func()) {
	s := nodeagent.NewServer(nodeagent.Params{
		Log: hivetest.Logger(f.t), DB: f.db, Workloads: f.rows, Conns: f.conns, Path: f.path, Timeout: timeout,
		Open: func(w *nodeagent.Workload) (*os.File, error) { return os.Open(w.Netns) },
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	health, _ := cell.NewSimpleHealth()
	go func() {
		if err := s.Run(ctx, health); err != nil {
			f.t.Error(err)
		}
		close(done)
	}()
	f.eventually("socket", func() error { _, err := os.Stat(f.path); return err })
	return sync.OnceFunc(func() { cancel(); <-done })
}

func (f *fixture) put(pod string, netns string) {
	ns, name, _ := strings.Cut(pod, "/")
	wtxn := f.db.WriteTxn(f.rows)
	f.rows.Insert(wtxn, &nodeagent.Workload{Pod: pod, UID: "uid-" + name, Name: name, Namespace: ns, ServiceAccount: "sa-" + name,
		Netns: netns, State: nodeagent.StatePending})
	wtxn.Commit()
}

func (f *fixture) remove(pod string) {
	wtxn := f.db.WriteTxn(f.rows)
	if w, _, ok := f.rows.Get(wtxn, nodeagent.WorkloadByPod(pod)); ok {
		f.rows.Delete(wtxn, w)
	}
	wtxn.Commit()
}

// states is the rows as "pod state conn error".
func (f *fixture) states() string {
	var out []string
	for w := range f.rows.All(f.db.ReadTxn()) {
		out = append(out, fmt.Sprintf("%s %s %d %s", w.Pod, w.State, w.Conn, w.Error))
	}
	return strings.Join(out, "; ")
}

func (f *fixture) eventually(what string, cond func() error) {
	f.t.Helper()
	deadline := time.Now().Add(waitTimeout)
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			f.t.Fatalf("%s: %v; rows: %s", what, err, f.states())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func (f *fixture) wantStates(want ...string) {
	f.t.Helper()
	f.eventually("states", func() error {
		got := f.states()
		for _, w := range want {
			if !strings.Contains(got, w) {
				return fmt.Errorf("no %q", w)
			}
		}
		return nil
	})
}

func (f *fixture) wantServing(z *ztunnel, want ...string) {
	f.t.Helper()
	f.eventually("ztunnel serving", func() error {
		if got := z.serving(); !slices.Equal(got, want) {
			return fmt.Errorf("serving %q, want %q", got, want)
		}
		return nil
	})
}

func (f *fixture) newest() uint64 {
	c, ok := nodeagent.Newest(f.db.ReadTxn(), f.conns)
	if !ok {
		return 0
	}
	return c.ID
}

// TestSnapshotAndLive: the snapshot adds every pod with its namespace and
// its workload info, keeps the pod whose namespace is gone, then live adds
// and dels follow the table.
func TestSnapshotAndLive(t *testing.T) {
	f := newFixture(t, 0)
	f.put("app/a", f.netns)
	f.put("app/gone", "/nonexistent/netns")
	z := startZtunnel(t, f.path)
	f.wantStates("app/a acked 1 ", "app/gone kept 1 namespace not opened, keep sent")
	f.wantServing(z, "uid-a app/a sa=sa-a")

	f.put("app/b", f.netns)
	f.wantServing(z, "uid-a app/a sa=sa-a", "uid-b app/b sa=sa-b")
	f.remove("app/a")
	f.wantServing(z, "uid-b app/b sa=sa-b")
	f.wantStates("app/b acked 1 ")
	// A pod whose namespace goes after the snapshot cannot be kept any
	// more (fatal for ztunnel): it fails, retried with backoff.
	f.put("app/late", "/nonexistent/late")
	f.wantStates("app/late failed 1 namespace not opened")
	// The namespace of a pod changes (a new sandbox): a new add.
	f.put("app/b", "/proc/thread-self/ns/net")
	f.eventually("second add of b", func() error {
		z.mu.Lock()
		defer z.mu.Unlock()
		if n := strings.Count(strings.Join(z.events, ","), "add uid-b"); n != 2 {
			return fmt.Errorf("%d adds of b: %v", n, z.events)
		}
		return nil
	})
}

// TestSnapshotWaitsForTheTable: a ztunnel that connects while the table is
// not yet derived (the agent just restarted) gets its snapshot only once
// it is, with every pod: ztunnel drops the pods a snapshot lacks.
func TestSnapshotWaitsForTheTable(t *testing.T) {
	f := newFixture(t, 0)
	wtxn := f.db.WriteTxn(f.rows)
	derived := f.rows.RegisterInitializer(wtxn, "test")
	wtxn.Commit()
	z := startZtunnel(t, f.path)
	f.eventually("connection", func() error {
		if f.conns.NumObjects(f.db.ReadTxn()) == 0 {
			return errors.New("ztunnel not connected")
		}
		return nil
	})
	// A ztunnel that goes meanwhile is noticed: its slot is freed.
	gone := startZtunnel(t, f.path)
	f.eventually("second connection", func() error {
		if n := f.conns.NumObjects(f.db.ReadTxn()); n != 2 {
			return fmt.Errorf("%d connections", n)
		}
		return nil
	})
	gone.stop()
	f.eventually("the connection gone released", func() error {
		if n := f.conns.NumObjects(f.db.ReadTxn()); n != 1 {
			return fmt.Errorf("%d connections, want 1", n)
		}
		return nil
	})
	f.put("app/a", f.netns)
	time.Sleep(100 * time.Millisecond)
	for c := range f.conns.All(f.db.ReadTxn()) {
		if c.SnapshotSent {
			t.Fatal("snapshot sent before the table was derived")
		}
	}
	wtxn = f.db.WriteTxn(f.rows)
	derived(wtxn)
	wtxn.Commit()
	f.wantServing(z, "uid-a app/a sa=sa-a")
	// The snapshot follows the add; wait for it, then check the order.
	want := []string{"add uid-a", "snapshot"}
	f.eventually("the snapshot", func() error {
		z.mu.Lock()
		defer z.mu.Unlock()
		if len(z.events) < len(want) {
			return fmt.Errorf("ztunnel saw %q", z.events)
		}
		return nil
	})
	z.mu.Lock()
	defer z.mu.Unlock()
	if !slices.Equal(z.events, want) {
		t.Errorf("ztunnel saw %q, want %q", z.events, want)
	}
}

// TestReconnect: when ztunnel goes, the rows it held wait; when it comes
// back, the snapshot gives it every pod again.
func TestReconnect(t *testing.T) {
	f := newFixture(t, 0)
	f.put("app/a", f.netns)
	z := startZtunnel(t, f.path)
	f.wantStates("app/a acked 1 ")
	z.stop()
	f.wantStates("app/a pending 0 ztunnel connection 1 closed")
	if n := f.newest(); n != 0 {
		t.Errorf("connection %d still newest", n)
	}
	z2 := startZtunnel(t, f.path)
	f.wantStates("app/a acked 2 ")
	f.wantServing(z2, "uid-a app/a sa=sa-a")
}

// TestRestartKeepsPodsWithoutNamespace: an agent that restarts without the
// network namespace of a pod it knows (its CNI report was lost) sends keep
// for it: ztunnel goes on serving the pod, which its rules still steer to
// it, instead of draining it; it is never deleted while its row is there.
func TestRestartKeepsPodsWithoutNamespace(t *testing.T) {
	f := newTables(t)
	stop := f.serve(0)
	t.Cleanup(stop)
	f.put("app/a", f.netns)
	z := startZtunnel(t, f.path)
	f.wantServing(z, "uid-a app/a sa=sa-a")

	stop()
	wtxn := f.db.WriteTxn(f.rows, f.conns)
	w, _, _ := f.rows.Get(wtxn, nodeagent.WorkloadByPod("app/a"))
	w = &nodeagent.Workload{Pod: w.Pod, UID: w.UID, Name: w.Name, Namespace: w.Namespace, ServiceAccount: w.ServiceAccount,
		Problem: "no network namespace known", State: nodeagent.StatePending}
	f.rows.Insert(wtxn, w)
	f.conns.DeleteAll(wtxn)
	wtxn.Commit()
	t.Cleanup(f.serve(0))
	f.eventually("a second snapshot", func() error {
		z.mu.Lock()
		defer z.mu.Unlock()
		if n := strings.Count(strings.Join(z.events, ","), "snapshot"); n < 2 {
			return fmt.Errorf("ztunnel saw %q", z.events)
		}
		return nil
	})
	f.put("app/b", f.netns) // a live change: a sync after the snapshot
	f.wantServing(z, "uid-a app/a sa=sa-a", "uid-b app/b sa=sa-b")
	// Its namespace known again: added again.
	f.put("app/a", f.netns)
	f.wantStates("app/a acked")
}

// TestTwoConnections: adds go to the newest connection, dels to all; when
// the newest goes, the older one takes over and holds what it was told.
func TestTwoConnections(t *testing.T) {
	f := newFixture(t, 0)
	f.put("app/a", f.netns)
	old := startZtunnel(t, f.path)
	f.wantStates("app/a acked 1 ")
	young := startZtunnel(t, f.path)
	f.wantStates("app/a acked 2 ")
	f.wantServing(young, "uid-a app/a sa=sa-a")
	f.put("app/b", f.netns)
	f.wantServing(young, "uid-a app/a sa=sa-a", "uid-b app/b sa=sa-b")
	f.wantServing(old, "uid-a app/a sa=sa-a") // no add for the old one
	f.remove("app/a")
	f.wantServing(old)
	f.wantServing(young, "uid-b app/b sa=sa-b")
	young.stop()
	// The old connection is the newest again: b is added there.
	f.wantStates("app/b acked 1 ")
	f.wantServing(old, "uid-b app/b sa=sa-b")
}

// TestNack: a refused add is recorded with ztunnel's reason and sent again
// with backoff until it is taken.
func TestNack(t *testing.T) {
	f := newFixture(t, 0)
	z := startZtunnel(t, f.path)
	z.mu.Lock()
	z.fail["uid-a"] = errors.New("cannot bind 15008")
	z.mu.Unlock()
	// The pod comes after the failure is armed: had it been in the table
	// first, the snapshot could have been taken before the refusal.
	f.put("app/a", f.netns)
	f.wantStates("app/a nacked 1 cannot bind 15008")
	z.mu.Lock()
	delete(z.fail, "uid-a")
	z.mu.Unlock()
	f.wantStates("app/a acked 1 ")
}

// TestHostileClients: clients that say no hello, a bad one, or never
// answer lose their connection; the server serves the next one.
func TestHostileClients(t *testing.T) {
	f := newFixture(t, 300*time.Millisecond)
	f.put("app/a", f.netns)
	dial := func() *net.UnixConn {
		c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: f.path, Net: "unixpacket"})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	closed := func(c *net.UnixConn) {
		t.Helper()
		c.SetReadDeadline(time.Now().Add(3 * time.Second))
		buf := make([]byte, 2048)
		for {
			n, _, err := c.ReadFromUnix(buf)
			if err != nil || n == 0 {
				if errors.Is(err, os.ErrDeadlineExceeded) {
					t.Error("connection still open")
				}
				return
			}
		}
	}
	silent := dial()
	garbage := dial()
	garbage.Write([]byte{0xff, 0xff, 0xff})
	oldVersion := dial()
	oldVersion.Write([]byte{0x08, 0x00}) // a hello of version NOT_USED
	mute := zds.NewConn(dial())
	if err := mute.SendHello(); err != nil {
		t.Fatal(err)
	}
	closed(silent)
	closed(garbage)
	closed(oldVersion)
	// The mute client got the add and never answers: its connection goes.
	f.eventually("mute connection dropped", func() error {
		if n := f.conns.NumObjects(f.db.ReadTxn()); n != 0 {
			return fmt.Errorf("%d connections", n)
		}
		return nil
	})
	z := startZtunnel(t, f.path)
	f.wantServing(z, "uid-a app/a sa=sa-a")
}

// TestTooLarge: a pod whose add would not fit ztunnel's buffer is never
// sent; the others are.
func TestTooLarge(t *testing.T) {
	f := newFixture(t, 0)
	f.put("app/"+strings.Repeat("x", 1100), f.netns)
	f.put("app/b", f.netns)
	z := startZtunnel(t, f.path)
	f.wantStates("failed 1 zds: bad message: ", "app/b acked 1 ")
	f.wantServing(z, "uid-b app/b sa=sa-b")
}
