// SPDX-License-Identifier: Apache-2.0

package zds

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"time"

	"istio.io/istio/pkg/zdsapi"
)

// Handler serves pods on ztunnel's side of ZDS.
type Handler interface {
	// Add starts serving the pod uid inside netns, which the handler now
	// owns. An add of a uid it serves in the same namespace changes
	// nothing; in another namespace it replaces the old one. An error is
	// sent back as the nack's reason; the connection goes on.
	Add(uid string, info *zdsapi.WorkloadInfo, netns *os.File) error
	// Del stops serving the pod; an unknown uid is not an error.
	Del(uid string)
	// Reconcile stops every pod whose uid keep does not hold: the node
	// agent's snapshot is complete.
	Reconcile(keep map[string]bool)
}

// Client is ztunnel's side of ZDS: it connects to the node agent's socket,
// says hello and serves the requests, with ztunnel's rules.
type Client struct {
	// Path of the node agent's socket (ztunnel's INPOD_UDS).
	Path    string
	Handler Handler
	Log     *slog.Logger
	// MaxBackoff bounds the wait between connection attempts, which starts
	// at 10ms and doubles (ztunnel's: 15s).
	MaxBackoff time.Duration
	// Connected, if set, is called after each hello, with the connection's
	// sequence number; SnapshotDone once its snapshot was reconciled.
	Connected, SnapshotDone func(n int)
}

// Run connects and serves until ctx ends (nil) or the node agent breaks
// the protocol in a way ztunnel finds fatal (an error wrapping
// ErrProtocol: ztunnel then shuts down). A lost connection is made again,
// and the pods served so far stay served until the next snapshot says.
func (c *Client) Run(ctx context.Context) error {
	maxBackoff := c.MaxBackoff
	if maxBackoff == 0 {
		maxBackoff = 15 * time.Second
	}
	backoff := 10 * time.Millisecond
	for n := 1; ctx.Err() == nil; {
		conn, err := Dial(c.Path)
		if err != nil {
			c.Log.Debug("Cannot connect to the node agent", "socket", c.Path, "error", err, "retry", backoff)
			select {
			case <-ctx.Done():
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, maxBackoff)
			continue
		}
		backoff = 10 * time.Millisecond
		err = c.Serve(ctx, conn, n)
		n++
		switch {
		case errors.Is(err, ErrProtocol):
			return err
		case err != nil && ctx.Err() == nil:
			c.Log.Warn("ZDS connection ended", "error", err)
		}
	}
	return nil
}

// Serve says hello on conn and serves its requests until it ends: nil at
// the node agent's EOF or when ctx ends, else the error (ErrProtocol
// fatal, others end this connection only). It closes conn.
func (c *Client) Serve(ctx context.Context, conn *Conn, n int) error {
	defer conn.Close()
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	if err := conn.SendHello(); err != nil {
		return err
	}
	if c.Connected != nil {
		c.Connected(n)
	}
	s := &clientState{names: map[string]bool{}}
	for {
		req, fds, err := conn.ReadRequest()
		if err != nil {
			if errors.Is(err, io.EOF) || ctx.Err() != nil {
				return nil
			}
			// As ztunnel: the reason goes back as a nack, then the
			// connection goes.
			conn.SendAck(err)
			return err
		}
		err = c.serve(s, req, fds)
		if errors.Is(err, ErrProtocol) || errors.Is(err, ErrMessage) {
			conn.SendAck(err)
			return err
		}
		if aerr := conn.SendAck(err); aerr != nil {
			return aerr
		}
		if req.GetSnapshotSent() != nil && c.SnapshotDone != nil {
			c.SnapshotDone(n)
		}
	}
}

// clientState is one connection's progress through the protocol.
type clientState struct {
	snapshotSent bool
	// names are the uids added or kept before snapshot_sent.
	names map[string]bool
}

// serve handles one request. ErrProtocol and ErrMessage end the
// connection; other errors are nacks.
func (c *Client) serve(s *clientState, req *zdsapi.WorkloadRequest, fds []*os.File) error {
	onlyAdd := func() error {
		if len(fds) > 0 {
			closeAll(fds)
			return fmt.Errorf("%w: a descriptor with %T", ErrMessage, req.GetPayload())
		}
		return nil
	}
	switch p := req.GetPayload().(type) {
	case *zdsapi.WorkloadRequest_Add:
		if len(fds) != 1 {
			closeAll(fds)
			return fmt.Errorf("%w: an add with %d descriptors, want 1", ErrMessage, len(fds))
		}
		add := p.Add
		if add.GetWorkloadInfo() == nil {
			fds[0].Close()
			return fmt.Errorf("%w: add of %q without workload_info", ErrProtocol, add.GetUid())
		}
		if !s.snapshotSent {
			s.names[add.GetUid()] = true
		}
		if err := CheckNetns(fds[0]); err != nil {
			fds[0].Close()
			return err
		}
		c.Log.Info("Pod added", "uid", add.GetUid(), "namespace", add.GetWorkloadInfo().GetNamespace(),
			"name", add.GetWorkloadInfo().GetName(), "serviceAccount", add.GetWorkloadInfo().GetServiceAccount())
		return c.Handler.Add(add.GetUid(), add.GetWorkloadInfo(), fds[0])
	case *zdsapi.WorkloadRequest_Keep:
		if err := onlyAdd(); err != nil {
			return err
		}
		if s.snapshotSent {
			return fmt.Errorf("%w: keep of %q after snapshot_sent", ErrProtocol, p.Keep.GetUid())
		}
		s.names[p.Keep.GetUid()] = true
		return nil
	case *zdsapi.WorkloadRequest_Del:
		if err := onlyAdd(); err != nil {
			return err
		}
		if !s.snapshotSent {
			delete(s.names, p.Del.GetUid())
			return nil
		}
		c.Log.Info("Pod deleted", "uid", p.Del.GetUid())
		c.Handler.Del(p.Del.GetUid())
		return nil
	case *zdsapi.WorkloadRequest_SnapshotSent:
		if err := onlyAdd(); err != nil {
			return err
		}
		if s.snapshotSent {
			return fmt.Errorf("%w: a second snapshot_sent", ErrProtocol)
		}
		s.snapshotSent = true
		c.Handler.Reconcile(s.names)
		c.Log.Info("Snapshot received", "pods", len(s.names))
		s.names = nil
		return nil
	}
	closeAll(fds)
	return fmt.Errorf("%w: a request without payload", ErrMessage)
}
