// SPDX-License-Identifier: Apache-2.0

package proxy

import (
	"crypto/tls"
	"net"
	"sync"
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
type batchedTLS struct {
	*tls.Conn
	raw *batchingConn
	wmu sync.Mutex
}

func (t *batchedTLS) Write(p []byte) (int, error) {
	t.wmu.Lock()
	defer t.wmu.Unlock()
	t.raw.hold()
	n, err := t.Conn.Write(p)
	if rerr := t.raw.release(); err == nil && rerr != nil {
		return 0, rerr
	}
	return n, err
}

// newBatchedTLS wraps raw for tls (tls.Client or tls.Server).
func newBatchedTLS(raw net.Conn, wrap func(net.Conn) *tls.Conn) *batchedTLS {
	b := &batchingConn{Conn: raw}
	return &batchedTLS{Conn: wrap(b), raw: b}
}
