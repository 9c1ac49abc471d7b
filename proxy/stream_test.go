// SPDX-License-Identifier: Apache-2.0

package proxy

import (
	"io"
	"net"
	"net/http"
	"net/netip"
	"testing"
	"time"

	"golang.org/x/net/http2"
)

// TestStreamsWaitWithoutABuffer: both ends of an HBONE tunnel wait for data
// with a read of nothing, which returns only once data (then read whole)
// or the end is there. If x/net's bodies returned from it at once, an idle
// tunnel's relay would block in a read holding a copy buffer.
func TestStreamsWaitWithoutABuffer(t *testing.T) {
	clientSide, serverSide := net.Pipe()
	t.Cleanup(func() { clientSide.Close(); serverSide.Close() })
	accepted := make(chan *serverStream, 1)
	handled := make(chan struct{})
	go newHBONEServer().ServeConn(serverSide, &http2.ServeConnOpts{Handler: http.HandlerFunc(
		func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusOK)
			s := newServerStream(w, r)
			s.flusher.Flush()
			accepted <- s
			<-handled
			s.finish()
		})})
	t.Cleanup(func() { close(handled) })
	cc, err := newHBONETransport().NewClientConn(clientSide)
	must(t, err)
	client := openTestTunnel(t, cc)
	t.Cleanup(func() { client.Close() })
	server := <-accepted

	for _, c := range []struct {
		name    string
		waiter  readableWaiter
		from    io.Reader
		to      io.Writer
		closeTo func() error
	}{
		{"server waits for the client", server, server, client, client.CloseWrite},
		{"client waits for the server", client, client, server, nil},
	} {
		waited := make(chan error, 1)
		go func() { waited <- c.waiter.waitReadable() }()
		select {
		case err := <-waited:
			t.Fatalf("%s: returned before any data: %v", c.name, err)
		case <-time.After(100 * time.Millisecond):
		}
		if _, err := c.to.Write([]byte("hello")); err != nil {
			t.Fatal(err)
		}
		select {
		case err := <-waited:
			must(t, err)
		case <-time.After(5 * time.Second):
			t.Fatalf("%s: still waiting after data came", c.name)
		}
		buf := make([]byte, 16)
		if n, err := c.from.Read(buf); err != nil || string(buf[:n]) != "hello" {
			t.Fatalf("%s: read %q %v after the wait, want all of it", c.name, buf[:n], err)
		}
		if c.closeTo == nil {
			continue
		}
		// The end: the wait returns, and the read after it says EOF.
		must(t, c.closeTo())
		must(t, c.waiter.waitReadable())
		if n, err := c.from.Read(buf); n != 0 || err != io.EOF {
			t.Fatalf("%s: read %d %v after the end, want EOF", c.name, n, err)
		}
	}
}

// openTestTunnel opens a tunnel on cc; its addresses only name it, nothing
// dials them.
func openTestTunnel(t testing.TB, cc *http2.ClientConn) *clientStream {
	t.Helper()
	s, err := openTunnel(cc, "10.0.0.1:80", forwardedFor(netip.MustParseAddrPort("10.0.0.2:1234")))
	must(t, err)
	return s
}
