// SPDX-License-Identifier: Apache-2.0

package nodeagent

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"golang.org/x/time/rate"
	"istio.io/istio/pkg/zdsapi"

	"github.com/mtlsbridge/mtlsbridge/statedir"
	"github.com/mtlsbridge/mtlsbridge/zds"
)

// Bounds of the server, for what a connection's peer controls.
const (
	// RequestTimeout bounds the hello and each acknowledgement (istio-cni's
	// deadline): a ztunnel that does not answer in time loses the
	// connection, since the lock-step is lost.
	RequestTimeout = 5 * time.Second
	// keepalive: how often an idle connection is checked, so that a
	// ztunnel that went away is noticed (and its pods are no longer
	// counted as held) within that time.
	keepalive = time.Second
	// MaxConnections connected at once; more are closed at once. Two are
	// expected (a ztunnel and its replacement during a rolling update).
	MaxConnections = 4
	// acceptRate bounds new connections (istio-cni's: 5 a second): a
	// client looping on connect costs little.
	acceptRate = 5
	// retryMin and retryMax bound the backoff of an add that was refused
	// or could not be sent.
	retryMin = time.Second
	retryMax = 30 * time.Second
)

// Opener opens the network namespace of a pod, checked to be the pod's.
// An error wrapping os.ErrNotExist means the namespace is gone: a
// snapshot then sends keep, so that ztunnel keeps what it has of the pod.
type Opener func(w *Workload) (*os.File, error)

// Params of a server.
type Params struct {
	Log       *slog.Logger
	DB        *statedb.DB
	Workloads statedb.RWTable[*Workload]
	Conns     statedb.RWTable[*Connection]
	Open      Opener
	// Path of the socket ztunnel connects to (INPOD_UDS).
	Path string
	// Timeout bounds the hello and each acknowledgement; 0 is
	// RequestTimeout.
	Timeout time.Duration
	// Metrics, if set, count requests and connections.
	Metrics *Metrics
}

// Server is the node agent's side of ZDS: it keeps every connected
// ztunnel told of the pods of the zds table.
type Server struct {
	Params

	handlers atomic.Int32

	mu            sync.Mutex
	nextID        uint64
	live          map[uint64]bool
	newest        uint64
	newestChanged chan struct{}
}

// NewServer returns a server; Run serves.
func NewServer(p Params) *Server {
	if p.Timeout == 0 {
		p.Timeout = RequestTimeout
	}
	if p.Metrics == nil {
		p.Metrics, _ = NewMetrics(nil)
	}
	return &Server{Params: p, live: map[uint64]bool{}, newestChanged: make(chan struct{})}
}

// Run listens on the socket and serves connections until ctx ends. The
// socket is 0600 from the moment it appears; a stale one is replaced,
// anything else at its path is refused.
func (s *Server) Run(ctx context.Context, health cell.Health) error {
	if err := os.MkdirAll(filepath.Dir(s.Path), 0o700); err != nil {
		return fmt.Errorf("--zds-socket=%s: %w", s.Path, err)
	}
	if st, err := os.Lstat(s.Path); err == nil && st.Mode().Type() != os.ModeSocket {
		return fmt.Errorf("--zds-socket=%s: %w", s.Path, ErrNotSocket)
	}
	l, err := statedir.ListenUnixPacket(s.Path)
	if err != nil {
		return fmt.Errorf("--zds-socket=%s: %w", s.Path, err)
	}
	defer statedir.CloseUnix(l, s.Path)
	stop := context.AfterFunc(ctx, func() { l.Close() })
	defer stop()
	health.OK("listening on " + s.Path)
	s.Log.Info("ZDS server listening", "socket", s.Path)

	var wg sync.WaitGroup
	defer wg.Wait()
	limit := rate.NewLimiter(acceptRate, 1)
	for {
		if err := limit.Wait(ctx); err != nil {
			return nil
		}
		c, err := l.AcceptUnix()
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return nil
			}
			s.Log.Warn("ZDS accept failed", "error", err)
			continue
		}
		if s.handlers.Add(1) > MaxConnections {
			s.handlers.Add(-1)
			s.Log.Warn("ZDS connection refused: too many", "max", MaxConnections)
			c.Close()
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer s.handlers.Add(-1)
			s.serve(ctx, zds.NewConn(c))
		}()
	}
}

// sent is what one connection was told of one uid, and how it went.
type sent struct {
	fingerprint string
	state       string
	err         string
	retryAt     time.Time
	backoff     time.Duration
}

// conn is one connection after its hello.
type conn struct {
	id   uint64
	c    *zds.Conn
	sent map[string]*sent // by uid
}

func (s *Server) serve(ctx context.Context, zc *zds.Conn) {
	defer zc.Close()
	stop := context.AfterFunc(ctx, func() { zc.Close() })
	defer stop()
	zc.SetDeadline(time.Now().Add(s.Timeout))
	if _, err := zc.ReadHello(); err != nil {
		s.Log.Warn("ZDS connection without a valid hello", "error", err)
		return
	}
	c := &conn{c: zc, sent: map[string]*sent{}}
	s.register(c)
	defer s.unregister(c)
	s.Log.Info("ztunnel connected", "conn", c.id)
	err := s.run(ctx, c)
	if ctx.Err() != nil {
		err = nil
	}
	s.Log.Info("ztunnel connection ended", "conn", c.id, "error", err)
}

// run sends the snapshot, then follows the table.
func (s *Server) run(ctx context.Context, c *conn) error {
	if err := s.waitDerived(ctx, c); err != nil || ctx.Err() != nil {
		return err
	}
	if err := s.snapshot(c); err != nil {
		return fmt.Errorf("snapshot: %w", err)
	}
	tick := time.NewTicker(keepalive)
	defer tick.Stop()
	for {
		txn := s.DB.ReadTxn()
		rows, watch := s.Workloads.AllWatch(txn)
		newest, newestChanged := s.isNewest(c)
		next, err := s.sync(c, slices.Collect(statedb.ToSeq(rows)), newest)
		if err != nil {
			return err
		}
		var retry <-chan time.Time
		var timer *time.Timer
		if !next.IsZero() {
			timer = time.NewTimer(time.Until(next))
			retry = timer.C
		}
		select {
		case <-ctx.Done():
		case <-watch:
		case <-newestChanged:
		case <-retry:
		case <-tick.C:
			err = c.c.CheckAlive()
		}
		if timer != nil {
			timer.Stop()
		}
		if err != nil || ctx.Err() != nil {
			return err
		}
	}
}

// waitDerived waits until the table is derived from a full view: ztunnel
// drops the pods a snapshot lacks, and with them their connections (an
// agent restarted has its table empty for a moment). Meanwhile it checks
// that ztunnel is still there, so that one gone frees its slot.
func (s *Server) waitDerived(ctx context.Context, c *conn) error {
	tick := time.NewTicker(keepalive)
	defer tick.Stop()
	for {
		ok, derived := s.Workloads.Initialized(s.DB.ReadTxn())
		if ok {
			return nil
		}
		select {
		case <-ctx.Done():
			return nil
		case <-derived:
		case <-tick.C:
			if err := c.c.CheckAlive(); err != nil {
				return err
			}
		}
	}
}

// snapshot sends every pod of the table (add, or keep when its namespace
// is not known or cannot be opened), then snapshot_sent.
func (s *Server) snapshot(c *conn) error {
	for _, w := range sortedRows(s.Workloads.All(s.DB.ReadTxn())) {
		if !w.keepable() {
			continue
		}
		if !w.sendable() {
			// Its namespace is not known (a restart lost its CNI report):
			// ztunnel keeps what it serves of the pod rather than drain
			// it, and the rules in the pod keep pointing at something.
			if err := s.request(c, keepRequest(w.UID), nil); err != nil && !isNack(err) {
				return err
			}
			held(c, w)
			continue
		}
		f, err := s.Open(w)
		if err != nil {
			if rerr := s.request(c, keepRequest(w.UID), nil); rerr != nil && !isNack(rerr) {
				return rerr
			}
			s.record(c, w, StateKept, fmt.Sprintf("namespace not opened, keep sent: %v", err))
			continue
		}
		if err := s.sendAdd(c, w, f); err != nil {
			return err
		}
	}
	if err := s.request(c, &zdsapi.WorkloadRequest{Payload: &zdsapi.WorkloadRequest_SnapshotSent{SnapshotSent: &zdsapi.SnapshotSent{}}}, nil); err != nil {
		return err
	}
	wtxn := s.DB.WriteTxn(s.Conns)
	if row, _, ok := s.Conns.Get(wtxn, ConnectionByID(c.id)); ok {
		row = ptrClone(row)
		row.SnapshotSent = true
		s.Conns.Insert(wtxn, row)
	}
	wtxn.Commit()
	s.Log.Info("ZDS snapshot sent", "conn", c.id, "pods", len(c.sent))
	return nil
}

// sync brings one connection up to date with the table: dels of what it
// was told and is gone, and, on the newest connection, adds of what it
// does not hold. It returns when a refused add is due again.
func (s *Server) sync(c *conn, rows []*Workload, newest bool) (time.Time, error) {
	desired := map[string]*Workload{}
	for _, w := range rows {
		if w.keepable() {
			if _, dup := desired[w.UID]; !dup || (w.sendable() && !desired[w.UID].sendable()) {
				desired[w.UID] = w
			}
		}
	}
	for _, uid := range slices.Sorted(maps.Keys(c.sent)) {
		if _, ok := desired[uid]; ok {
			continue
		}
		err := s.request(c, &zdsapi.WorkloadRequest{Payload: &zdsapi.WorkloadRequest_Del{Del: &zdsapi.DelWorkload{Uid: uid}}}, nil)
		if err != nil && !isNack(err) {
			return time.Time{}, err
		}
		s.Log.Info("ZDS del", "conn", c.id, "uid", uid, "error", err)
		delete(c.sent, uid)
	}
	if !newest {
		return time.Time{}, nil
	}
	var next time.Time
	now := time.Now()
	for _, w := range rows {
		if desired[w.UID] != w {
			continue
		}
		if !w.sendable() {
			if c.sent[w.UID] != nil {
				held(c, w) // an add due for retry waits for a row it can send
			}
			continue
		}
		st := c.sent[w.UID]
		if st != nil && st.fingerprint == fingerprint(w) {
			if st.state == StateAcked || now.Before(st.retryAt) {
				s.record(c, w, st.state, st.err) // held here, or not due yet
				if st.state != StateAcked && (next.IsZero() || st.retryAt.Before(next)) {
					next = st.retryAt
				}
				continue
			}
		}
		f, err := s.Open(w)
		if err != nil {
			s.failed(c, w, StateFailed, fmt.Sprintf("namespace not opened: %v", err))
			continue
		}
		if err := s.sendAdd(c, w, f); err != nil {
			return time.Time{}, err
		}
	}
	for _, st := range c.sent {
		if st.state != StateAcked && !st.retryAt.IsZero() && (next.IsZero() || st.retryAt.Before(next)) {
			next = st.retryAt
		}
	}
	return next, nil
}

// held notes that c may serve w, whose row cannot be sent (its namespace
// is not known): kept, and not retried (no retryAt) until the row can be.
func held(c *conn, w *Workload) {
	c.sent[w.UID] = &sent{fingerprint: fingerprint(w), state: StateKept, err: w.Problem}
}

// sendAdd sends the add of w with its namespace f (closed here). Only a
// lost connection is returned; a refusal is recorded.
func (s *Server) sendAdd(c *conn, w *Workload, f *os.File) error {
	defer f.Close()
	req := &zdsapi.WorkloadRequest{Payload: &zdsapi.WorkloadRequest_Add{Add: &zdsapi.AddWorkload{
		Uid:          w.UID,
		WorkloadInfo: &zdsapi.WorkloadInfo{Name: w.Name, Namespace: w.Namespace, ServiceAccount: w.ServiceAccount},
	}}}
	err := s.request(c, req, f)
	var nack *zds.NackError
	switch {
	case err == nil:
		s.Log.Info("ZDS add acknowledged", "conn", c.id, "pod", w.Pod, "uid", w.UID)
		s.record(c, w, StateAcked, "")
	case errors.As(err, &nack):
		s.Log.Warn("ZDS add refused by ztunnel", "conn", c.id, "pod", w.Pod, "uid", w.UID, "error", nack.Reason)
		s.failed(c, w, StateNacked, nack.Reason)
	case errors.Is(err, zds.ErrMessage):
		// Nothing was sent: the connection is still in step.
		s.Log.Error("ZDS add cannot be sent", "pod", w.Pod, "error", err)
		s.failed(c, w, StateFailed, err.Error())
	default:
		return err
	}
	return nil
}

// failed records a refused or unsendable add with backoff.
func (s *Server) failed(c *conn, w *Workload, state, reason string) {
	st := c.sent[w.UID]
	backoff := retryMin
	if st != nil && st.fingerprint == fingerprint(w) && st.backoff > 0 {
		backoff = min(2*st.backoff, retryMax)
	}
	c.sent[w.UID] = &sent{fingerprint: fingerprint(w), state: state, err: reason, retryAt: time.Now().Add(backoff), backoff: backoff}
	s.write(c, w, state, reason)
}

// record notes what the connection holds of w and writes it into w's row.
func (s *Server) record(c *conn, w *Workload, state, reason string) {
	st := c.sent[w.UID]
	if st == nil || st.fingerprint != fingerprint(w) || st.state != state {
		st = &sent{fingerprint: fingerprint(w), state: state, err: reason}
		if state != StateAcked {
			st.retryAt, st.backoff = time.Now().Add(retryMin), retryMin
		}
		c.sent[w.UID] = st
	}
	s.write(c, w, state, reason)
}

// write sets the state of w's row, unless the row changed since (the
// derivation then reset it to pending, and the next sync sends it).
func (s *Server) write(c *conn, w *Workload, state, reason string) {
	if w.State == state && w.Conn == c.id && w.Error == reason {
		return // as read: most passes change nothing
	}
	wtxn := s.DB.WriteTxn(s.Workloads)
	defer wtxn.Abort()
	cur, _, ok := s.Workloads.Get(wtxn, WorkloadByPod(w.Pod))
	if !ok || fingerprint(cur) != fingerprint(w) || !cur.sendable() ||
		(cur.State == state && cur.Conn == c.id && cur.Error == reason) {
		return
	}
	n := cur.clone()
	n.State, n.Conn, n.Error = state, c.id, reason
	s.Workloads.Insert(wtxn, n)
	wtxn.Commit()
}

func (s *Server) request(c *conn, req *zdsapi.WorkloadRequest, f *os.File) error {
	err := c.c.Request(req, f, time.Now().Add(s.Timeout))
	outcome := "acked"
	switch {
	case isNack(err):
		outcome = "nacked"
	case err != nil:
		outcome = "failed"
	}
	s.Metrics.Requests.WithLabelValues(requestType(req), outcome).Inc()
	return err
}

func requestType(req *zdsapi.WorkloadRequest) string {
	switch req.GetPayload().(type) {
	case *zdsapi.WorkloadRequest_Add:
		return "add"
	case *zdsapi.WorkloadRequest_Keep:
		return "keep"
	case *zdsapi.WorkloadRequest_Del:
		return "del"
	}
	return "snapshot_sent"
}

// register makes c the newest connection.
func (s *Server) register(c *conn) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.nextID++
	c.id = s.nextID
	s.live[c.id] = true
	s.Metrics.Connections.Set(float64(len(s.live)))
	s.setNewestLocked(c.id)
	wtxn := s.DB.WriteTxn(s.Conns)
	s.Conns.Insert(wtxn, &Connection{ID: c.id, Since: time.Now()})
	s.markNewestLocked(wtxn)
	wtxn.Commit()
}

// unregister forgets c; the most recent remaining connection, if any,
// becomes the newest, and the rows c held wait for it.
func (s *Server) unregister(c *conn) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.live, c.id)
	s.Metrics.Connections.Set(float64(len(s.live)))
	if s.newest == c.id {
		var last uint64
		for id := range s.live {
			last = max(last, id)
		}
		s.setNewestLocked(last)
	}
	wtxn := s.DB.WriteTxn(s.Conns, s.Workloads)
	if row, _, ok := s.Conns.Get(wtxn, ConnectionByID(c.id)); ok {
		s.Conns.Delete(wtxn, row)
	}
	s.markNewestLocked(wtxn)
	var held []*Workload
	for w := range s.Workloads.All(wtxn) {
		if w.Conn == c.id {
			held = append(held, w)
		}
	}
	for _, w := range held {
		n := w.clone()
		n.State, n.Conn, n.Error = StatePending, 0, fmt.Sprintf("ztunnel connection %d closed", c.id)
		s.Workloads.Insert(wtxn, n)
	}
	wtxn.Commit()
}

func (s *Server) setNewestLocked(id uint64) {
	s.newest = id
	close(s.newestChanged)
	s.newestChanged = make(chan struct{})
}

// markNewestLocked makes the rows of connections say which is newest.
func (s *Server) markNewestLocked(wtxn statedb.WriteTxn) {
	var change []*Connection
	for row := range s.Conns.All(wtxn) {
		if row.Newest != (row.ID == s.newest) {
			change = append(change, row)
		}
	}
	for _, row := range change {
		n := ptrClone(row)
		n.Newest = row.ID == s.newest
		s.Conns.Insert(wtxn, n)
	}
}

func (s *Server) isNewest(c *conn) (bool, <-chan struct{}) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.newest == c.id, s.newestChanged
}

func keepRequest(uid string) *zdsapi.WorkloadRequest {
	return &zdsapi.WorkloadRequest{Payload: &zdsapi.WorkloadRequest_Keep{Keep: &zdsapi.KeepWorkload{Uid: uid}}}
}

func isNack(err error) bool {
	var nack *zds.NackError
	return errors.As(err, &nack)
}

// fingerprint is what an add of w says: a change means a new add.
func fingerprint(w *Workload) string {
	return w.UID + "\x00" + w.Name + "\x00" + w.Namespace + "\x00" + w.ServiceAccount + "\x00" + w.Netns
}

func sortedRows(rows func(func(*Workload, statedb.Revision) bool)) []*Workload {
	var out []*Workload
	for w := range rows {
		out = append(out, w)
	}
	slices.SortFunc(out, func(a, b *Workload) int { return cmp.Compare(a.Pod, b.Pod) })
	return out
}

func ptrClone[T any](p *T) *T { c := *p; return &c }
