// SPDX-License-Identifier: Apache-2.0

package proxy

import (
	"context"
	"io"
	"sync"
	"sync/atomic"
	"time"
)

// Copy buffers: small while a direction trickles or waits, large while it
// streams (fewer system calls).
const (
	smallBuffer = 16 << 10
	largeBuffer = 256 << 10
)

// buffers are the proxy's copy buffers, shared by all connections.
type buffers struct{ small, large sync.Pool }

func newBuffers() *buffers {
	b := &buffers{}
	b.small.New = func() any { s := make([]byte, smallBuffer); return &s }
	b.large.New = func() any { s := make([]byte, largeBuffer); return &s }
	return b
}

// readableWaiter is a source that can wait for data without holding a
// buffer (a TCP connection, an HBONE stream): an idle connection then
// holds none.
type readableWaiter interface {
	waitReadable() error
}

// halfStream is one end of a proxied connection: a TCP connection, or an
// HBONE stream.
type halfStream interface {
	io.Reader
	io.Writer
	// CloseWrite tells the other side that no more data comes (TCP FIN,
	// HTTP/2 END_STREAM), reading goes on.
	CloseWrite() error
	Close() error
}

// relayResult is what crossed a connection.
type relayResult struct {
	// Sent flowed from the source to the destination, Received back.
	Sent, Received int64
	// Err is the first error other than an orderly end; nil when both
	// directions ended with EOF.
	Err error
}

// relayOptions shape one relay.
type relayOptions struct {
	// idle > 0 closes both ends after that long without a byte either way.
	idle time.Duration
	// sent and received are called as bytes flow (metrics).
	sent, received func(int)
	// returnOnReceivedEOF: relay returns as soon as dst's data has all
	// reached src, leaving the other direction to end by itself. The HBONE
	// server needs it: its stream's END_STREAM goes out only when the
	// handler returns, and a client may wait for it before it ends its
	// own direction.
	returnOnReceivedEOF bool
}

// relay copies both ways between src and dst until both directions have
// ended, passing each end (EOF) on as a half-close so that protocols that
// close one direction first keep working. The copy from dst to src runs in
// the caller's goroutine. An error in either direction, ctx ending, or
// the idle timeout closes both.
func relay(ctx context.Context, bufs *buffers, src, dst halfStream, opts relayOptions) relayResult {
	var (
		closeOnce sync.Once
		lastByte  atomic.Int64
		sent      atomic.Int64
		received  atomic.Int64
		mu        sync.Mutex
		firstErr  error
	)
	abort := func() {
		closeOnce.Do(func() {
			src.Close()
			dst.Close()
		})
	}
	fail := func(err error) {
		mu.Lock()
		if firstErr == nil {
			firstErr = err
		}
		mu.Unlock()
		abort()
	}
	stop := context.AfterFunc(ctx, func() { fail(context.Cause(ctx)) })
	defer stop()
	idle := opts.idle
	if idle > 0 {
		lastByte.Store(time.Now().UnixNano())
		var watchdog *time.Timer
		watchdog = time.AfterFunc(idle, func() {
			quiet := time.Since(time.Unix(0, lastByte.Load()))
			if quiet >= idle {
				fail(ErrIdle)
				return
			}
			watchdog.Reset(idle - quiet)
		})
		defer watchdog.Stop()
	}
	copyOne := func(to, from halfStream, count *atomic.Int64, add func(int)) {
		waiter, _ := from.(readableWaiter)
		large := false
		for {
			if waiter != nil {
				// Wait for data first: no buffer is held meanwhile.
				if err := waiter.waitReadable(); err != nil {
					fail(err)
					return
				}
			}
			pool := &bufs.small
			if large {
				pool = &bufs.large
			}
			buf := pool.Get().(*[]byte)
			n, rerr := from.Read(*buf)
			if n > 0 {
				lastByte.Store(time.Now().UnixNano())
				w, werr := to.Write((*buf)[:n])
				count.Add(int64(w))
				add(w)
				if werr != nil {
					pool.Put(buf)
					fail(werr)
					return
				}
			}
			pool.Put(buf)
			// A source that filled its buffer streams: a large one next;
			// one that did not is back to a small one.
			large = n == len(*buf) || (large && n >= smallBuffer)
			if rerr == io.EOF {
				if err := to.CloseWrite(); err != nil {
					fail(err)
				}
				return
			}
			if rerr != nil {
				fail(rerr)
				return
			}
		}
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		copyOne(dst, src, &sent, opts.sent)
	}()
	copyOne(src, dst, &received, opts.received)
	if opts.returnOnReceivedEOF {
		// The other direction ends once the caller lets go of src; then
		// both ends are closed.
		go func() { wg.Wait(); abort() }()
	} else {
		wg.Wait()
		abort()
	}
	mu.Lock()
	defer mu.Unlock()
	return relayResult{Sent: sent.Load(), Received: received.Load(), Err: firstErr}
}
