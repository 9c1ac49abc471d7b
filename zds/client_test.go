// SPDX-License-Identifier: Apache-2.0

package zds_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"
	"istio.io/istio/pkg/zdsapi"

	"github.com/mtlsbridge/mtlsbridge/zds"
)

// recorder is a Handler that records what it is asked.
type recorder struct {
	mu     sync.Mutex
	events []string
	fail   error
}

func (r *recorder) Add(uid string, info *zdsapi.WorkloadInfo, netns *os.File) error {
	netns.Close()
	r.note("add " + uid + " " + info.GetNamespace() + "/" + info.GetName() + " sa=" + info.GetServiceAccount())
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.fail
}
func (r *recorder) Del(uid string) { r.note("del " + uid) }
func (r *recorder) Reconcile(keep map[string]bool) {
	r.note("reconcile " + strings.Join(sortedKeys(keep), ","))
}
func (r *recorder) note(s string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.events = append(r.events, s)
}
func (r *recorder) all() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.events...)
}

func sortedKeys(m map[string]bool) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	for i := range out {
		for j := i + 1; j < len(out); j++ {
			if out[j] < out[i] {
				out[i], out[j] = out[j], out[i]
			}
		}
	}
	return out
}

// rawServer is a node agent written by hand, to send what a real one
// never should.
type rawServer struct {
	t *testing.T
	c *net.UnixConn
}

// serveOne starts a Client on a fresh socket and returns the server's end
// once the client said hello, and the client's result.
func serveOne(t *testing.T, h zds.Handler) (*rawServer, <-chan error) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "zds.sock")
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	done := make(chan error, 1)
	cl := &zds.Client{Path: path, Handler: h, Log: slog.New(slog.DiscardHandler), MaxBackoff: 50 * time.Millisecond}
	go func() { done <- cl.Run(ctx) }()
	l.SetDeadline(time.Now().Add(5 * time.Second))
	c, err := l.AcceptUnix()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	s := &rawServer{t: t, c: c}
	hello := &zdsapi.ZdsHello{}
	s.read(hello)
	if hello.GetVersion() != zdsapi.Version_V1 {
		t.Fatalf("hello %v", hello)
	}
	return s, done
}

func (s *rawServer) read(m proto.Message) {
	s.t.Helper()
	buf := make([]byte, 2048)
	s.c.SetDeadline(time.Now().Add(5 * time.Second))
	n, _, _, _, err := s.c.ReadMsgUnix(buf, nil)
	if err != nil {
		s.t.Fatal(err)
	}
	if err := proto.Unmarshal(buf[:n], m); err != nil {
		s.t.Fatal(err)
	}
}

// send writes raw bytes with descriptors and returns the ack's error text
// ("" for an ack).
func (s *rawServer) send(b []byte, fds ...*os.File) (string, error) {
	s.t.Helper()
	var oob []byte
	if len(fds) > 0 {
		ints := make([]int, len(fds))
		for i, f := range fds {
			ints[i] = int(f.Fd())
		}
		oob = unix.UnixRights(ints...)
	}
	if _, _, err := s.c.WriteMsgUnix(b, oob, nil); err != nil {
		return "", err
	}
	resp := &zdsapi.WorkloadResponse{}
	buf := make([]byte, 2048)
	s.c.SetDeadline(time.Now().Add(5 * time.Second))
	n, _, _, _, err := s.c.ReadMsgUnix(buf, nil)
	if err != nil {
		return "", err
	}
	if err := proto.Unmarshal(buf[:n], resp); err != nil {
		return "", err
	}
	return resp.GetAck().GetError(), nil
}

func (s *rawServer) request(req *zdsapi.WorkloadRequest, fds ...*os.File) string {
	s.t.Helper()
	b, err := proto.Marshal(req)
	if err != nil {
		s.t.Fatal(err)
	}
	e, err := s.send(b, fds...)
	if err != nil {
		s.t.Fatal(err)
	}
	return e
}

// netns opens a real network namespace: the test's own.
func netns(t *testing.T) *os.File {
	f, err := os.Open("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

func add(uid string, info *zdsapi.WorkloadInfo) *zdsapi.WorkloadRequest {
	return &zdsapi.WorkloadRequest{Payload: &zdsapi.WorkloadRequest_Add{Add: &zdsapi.AddWorkload{Uid: uid, WorkloadInfo: info}}}
}

func keep(uid string) *zdsapi.WorkloadRequest {
	return &zdsapi.WorkloadRequest{Payload: &zdsapi.WorkloadRequest_Keep{Keep: &zdsapi.KeepWorkload{Uid: uid}}}
}

func del(uid string) *zdsapi.WorkloadRequest {
	return &zdsapi.WorkloadRequest{Payload: &zdsapi.WorkloadRequest_Del{Del: &zdsapi.DelWorkload{Uid: uid}}}
}

var snapshotSent = &zdsapi.WorkloadRequest{Payload: &zdsapi.WorkloadRequest_SnapshotSent{SnapshotSent: &zdsapi.SnapshotSent{}}}

var info = &zdsapi.WorkloadInfo{Name: "web", Namespace: "app", ServiceAccount: "web"}

// TestClientProtocol: the client does what ztunnel does with a correct
// conversation: adds and keeps before the snapshot count for it, dels
// before it only unsay them, snapshot_sent drops the rest.
func TestClientProtocol(t *testing.T) {
	r := &recorder{}
	s, done := serveOne(t, r)
	for _, step := range []struct {
		req *zdsapi.WorkloadRequest
		fd  bool
	}{{add("u1", info), true}, {keep("u2"), false}, {add("u3", info), true}, {del("u3"), false}, {snapshotSent, false}, {add("u4", info), true}, {del("u1"), false}} {
		var fds []*os.File
		if step.fd {
			fds = append(fds, netns(t))
		}
		if e := s.request(step.req, fds...); e != "" {
			t.Fatalf("%v: nack %q", step.req, e)
		}
	}
	want := []string{"add u1 app/web sa=web", "add u3 app/web sa=web", "reconcile u1,u2", "add u4 app/web sa=web", "del u1"}
	if got := r.all(); strings.Join(got, "|") != strings.Join(want, "|") {
		t.Errorf("handler saw %q, want %q", got, want)
	}
	s.c.Close()
	select {
	case err := <-done:
		t.Fatalf("client stopped after the node agent closed: %v", err)
	case <-time.After(100 * time.Millisecond): // it reconnects
	}
}

// TestClientFatal: what ztunnel refuses. The three protocol errors stop the
// client (ztunnel shuts down); malformed datagrams end the connection
// only; a namespace that is not one, or a handler's failure, is a nack.
func TestClientFatal(t *testing.T) {
	notNetns, err := os.Open("/dev/null")
	if err != nil {
		t.Fatal(err)
	}
	defer notNetns.Close()
	big, _ := proto.Marshal(add("u1", &zdsapi.WorkloadInfo{Name: strings.Repeat("x", 1500)}))
	for _, c := range []struct {
		name   string
		before []*zdsapi.WorkloadRequest // acked first
		raw    []byte
		fds    func(t *testing.T) []*os.File
		fatal  bool // ErrProtocol: the client stops
		nack   string
		ends   bool // the connection ends, the client reconnects
	}{
		{name: "add without workload info", raw: mustMarshal(add("u1", nil)), fds: one, fatal: true, nack: "without workload_info"},
		{name: "keep after snapshot", before: []*zdsapi.WorkloadRequest{snapshotSent}, raw: mustMarshal(keep("u1")), fatal: true, nack: "keep"},
		{name: "a second snapshot", before: []*zdsapi.WorkloadRequest{snapshotSent}, raw: mustMarshal(snapshotSent), fatal: true, nack: "second snapshot"},
		{name: "add without descriptor", raw: mustMarshal(add("u1", info)), ends: true, nack: "0 descriptors"},
		{name: "add with two descriptors", raw: mustMarshal(add("u1", info)), fds: func(t *testing.T) []*os.File { return []*os.File{netns(t), netns(t)} }, ends: true, nack: "2 descriptors"},
		{name: "del with a descriptor", raw: mustMarshal(del("u1")), fds: one, ends: true, nack: "descriptor"},
		// An empty request would be an empty datagram: EOF, for ztunnel
		// too. An unknown field makes one that has no payload.
		{name: "no payload", raw: []byte{0x98, 0x06, 0x01}, ends: true, nack: "without payload"},
		{name: "not protobuf", raw: []byte{0xff, 0xff, 0xff}, ends: true, nack: "bad message"},
		{name: "truncated", raw: big, fds: one, ends: true, nack: "truncated"},
		{name: "descriptor not a namespace", raw: mustMarshal(add("u1", info)), fds: func(*testing.T) []*os.File { return []*os.File{notNetns} }, nack: "not a network namespace"},
	} {
		t.Run(c.name, func(t *testing.T) {
			s, done := serveOne(t, &recorder{})
			for _, req := range c.before {
				if e := s.request(req); e != "" {
					t.Fatalf("nack %q", e)
				}
			}
			var fds []*os.File
			if c.fds != nil {
				fds = c.fds(t)
			}
			nack, err := s.send(c.raw, fds...)
			if err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(nack, c.nack) {
				t.Errorf("nack %q, want one with %q", nack, c.nack)
			}
			select {
			case err := <-done:
				if !c.fatal || !errors.Is(err, zds.ErrProtocol) {
					t.Errorf("client stopped with %v", err)
				}
			case <-time.After(200 * time.Millisecond):
				if c.fatal {
					t.Error("client goes on after a fatal request")
				}
			}
			// After a nack that does not end it, the connection serves on.
			if !c.fatal && !c.ends {
				if e := s.request(snapshotSent); e != "" {
					t.Errorf("after the nack: %q", e)
				}
			}
			if c.ends {
				s.c.SetReadDeadline(time.Now().Add(time.Second))
				if _, _, _, _, err := s.c.ReadMsgUnix(make([]byte, 16), nil); !errors.Is(err, io.EOF) && err != nil {
					t.Errorf("connection not closed: %v", err)
				}
			}
		})
	}
}

func one(t *testing.T) []*os.File { return []*os.File{netns(t)} }

func mustMarshal(m proto.Message) []byte {
	b, err := proto.Marshal(m)
	if err != nil {
		panic(err)
	}
	return b
}

// TestClientNack: a handler that fails nacks with its reason; the
// connection serves on.
func TestClientNack(t *testing.T) {
	r := &recorder{fail: errors.New("no listener")}
	s, _ := serveOne(t, r)
	if e := s.request(add("u1", info), netns(t)); !strings.Contains(e, "no listener") {
		t.Errorf("nack %q", e)
	}
	r.mu.Lock()
	r.fail = nil
	r.mu.Unlock()
	if e := s.request(add("u1", info), netns(t)); e != "" {
		t.Errorf("second add: %q", e)
	}
}

// TestCheckNetns: a namespace passes, anything else does not.
func TestCheckNetns(t *testing.T) {
	if err := zds.CheckNetns(netns(t)); err != nil {
		t.Error(err)
	}
	f, _ := os.Open("/proc/self/ns/uts")
	defer f.Close()
	if err := zds.CheckNetns(f); !errors.Is(err, zds.ErrNotNetns) {
		t.Errorf("uts namespace: %v", err)
	}
}
