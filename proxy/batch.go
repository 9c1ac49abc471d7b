// SPDX-License-Identifier: Apache-2.0

package proxy

import (
	"crypto/tls"
	"math"
	"net"
	"sync"
	"time"

	"golang.org/x/net/http2"
)

// batchingConn is the TCP connection under a TLS connection. While a
// batch is open (during one write of the TLS connection) it gathers the
// TLS records instead of sending each with its own system call; the batch
// goes out in one. Outside a batch (alerts at Close) it writes through.
type batchingConn struct {
	net.Conn

	mu      sync.Mutex
	holding bool
	buf     []byte
}

func (c *batchingConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	if c.holding {
		c.buf = append(c.buf, p...)
		c.mu.Unlock()
		return len(p), nil
	}
	c.mu.Unlock()
	return c.Conn.Write(p)
}

func (c *batchingConn) hold() {
	c.mu.Lock()
	c.holding = true
	c.mu.Unlock()
}

// release sends what the batch gathered.
func (c *batchingConn) release() error {
	c.mu.Lock()
	c.holding = false
	b := c.buf
	c.buf = nil
	c.mu.Unlock()
	if len(b) == 0 {
		return nil
	}
	_, err := c.Conn.Write(b)
	c.mu.Lock()
	if c.buf == nil && cap(b) <= maxBatch {
		c.buf = b[:0]
	}
	c.mu.Unlock()
	return err
}

// maxBatch bounds the batch buffer kept between writes.
const maxBatch = 1 << 20

// batchedTLS is a TLS connection whose every Write leaves in one system
// call: HTTP/2 hands it whole frames, which TLS cuts into records of at
// most 16 KiB.
//
// A write of WINDOW_UPDATE frames alone waits up to windowUpdateDelay for
// the next write and leaves with it. x/net sends one each time 4 KiB of a
// stream were read (not configurable): every fourth 1 KiB request of a
// request/response tunnel, and one per read of a bulk stream, each a
// system call that also wakes the peer. The peer sends on meanwhile in the
// window it has: what waits is bounded (maxDeferredBytes of routine
// updates, a few hundred KiB) far below our windows (4 MiB a stream, 8 MiB
// and more a connection). A large update, such as the server's opening of
// its connection window, leaves at once.
type batchedTLS struct {
	*tls.Conn
	raw *batchingConn

	wmu      sync.Mutex
	frames   frameCursor
	deferred []byte        // WINDOW_UPDATE frames waiting for the next write
	delay    time.Duration // windowUpdateDelay; longer in a test
	timer    *time.Timer   // sends deferred when no write came in time
	err      error         // the timer's write failed: the connection is done

	clamp *frameSizeClamp // on the client's side: the peer's frame size, read
}

// Read is the TLS connection's; the client's side clamps the peer's frame
// size on the way (frameSizeClamp).
func (t *batchedTLS) Read(p []byte) (int, error) {
	if t.clamp == nil {
		return t.Conn.Read(p)
	}
	return t.clamp.read(t.Conn, p)
}

// Bounds of a deferred WINDOW_UPDATE.
const (
	windowUpdateDelay = time.Millisecond
	// maxDeferredBytes bounds what waits: 157 updates of a stream and its
	// connection, each 4 KiB or so.
	maxDeferredBytes = 4 << 10
	// maxDeferredIncrement: a larger update is not routine, it leaves at once.
	maxDeferredIncrement = 64 << 10
)

func (t *batchedTLS) Write(p []byte) (int, error) {
	t.wmu.Lock()
	defer t.wmu.Unlock()
	if t.err != nil {
		return 0, t.err
	}
	if t.frames.advance(p) && len(t.deferred)+len(p) <= maxDeferredBytes {
		if len(t.deferred) == 0 {
			t.timer.Reset(t.delay)
		}
		t.deferred = append(t.deferred, p...)
		return len(p), nil
	}
	t.raw.hold()
	err := t.writeDeferred()
	n := 0
	if err == nil {
		n, err = t.Conn.Write(p)
	}
	if rerr := t.raw.release(); err == nil && rerr != nil {
		return 0, rerr
	}
	return n, err
}

// writeDeferred writes the deferred frames; the caller holds wmu.
func (t *batchedTLS) writeDeferred() error {
	if len(t.deferred) == 0 {
		return nil
	}
	t.timer.Stop()
	_, err := t.Conn.Write(t.deferred)
	t.deferred = t.deferred[:0]
	return err
}

// sendDeferred is the timer's: the deferred frames go alone. If that
// fails, a TLS record may be lost, so the connection is closed and
// HTTP/2's next write gets the error.
func (t *batchedTLS) sendDeferred() {
	t.wmu.Lock()
	defer t.wmu.Unlock()
	t.raw.hold()
	err := t.writeDeferred()
	if rerr := t.raw.release(); err == nil {
		err = rerr
	}
	if err != nil && t.err == nil {
		t.err = err
		t.raw.Conn.Close()
	}
}

// Close sends TLS's close_notify unless a write is under way: that write
// may be blocked on a peer that does not read, and the close must end it
// at once (as tls.Conn does for its own writes).
func (t *batchedTLS) Close() error {
	t.timer.Stop()
	if !t.wmu.TryLock() {
		return t.raw.Conn.Close()
	}
	defer t.wmu.Unlock()
	if t.err == nil {
		t.err = net.ErrClosed
	}
	return t.Conn.Close()
}

// newBatchedTLS wraps raw for tls (tls.Client or tls.Server). client says
// which end of HTTP/2 writes into it (the client's first bytes are the
// preface, not a frame).
func newBatchedTLS(raw net.Conn, client bool, wrap func(net.Conn) *tls.Conn) *batchedTLS {
	b := &batchingConn{Conn: raw}
	t := &batchedTLS{Conn: wrap(b), raw: b, delay: windowUpdateDelay}
	if client {
		t.frames.rest = len(http2.ClientPreface)
		t.clamp = &frameSizeClamp{}
	}
	t.timer = time.AfterFunc(time.Duration(math.MaxInt64), t.sendDeferred)
	t.timer.Stop()
	return t
}
