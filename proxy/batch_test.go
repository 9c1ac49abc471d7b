// SPDX-License-Identifier: Apache-2.0

package proxy

import (
	"bytes"
	"crypto/tls"
	"io"
	"net"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"

	"github.com/mtlsbridge/mtlsbridge/identity"
)

// TestWindowUpdatesRideAlong: on a real HBONE tunnel over TLS, 64 request/
// response pairs of 1 KiB cost one TCP write per message at each end:
// the WINDOW_UPDATEs x/net makes every 4 KiB read leave with the next
// message. The last one, with no message after it, leaves by the timer.
func TestWindowUpdatesRideAlong(t *testing.T) {
	clientRaw, serverRaw := net.Pipe()
	clientSide, serverSide := &countingConn{Conn: clientRaw}, &countingConn{Conn: serverRaw}
	t.Cleanup(func() { clientRaw.Close(); serverRaw.Close() })
	client, server := batchedPair(t, clientSide, serverSide, true)
	// Long enough that no timer fires during the exchange: each update
	// must leave with a message.
	client.delay, server.delay = time.Second, time.Second

	go newHBONEServer().ServeConn(server, &http2.ServeConnOpts{Handler: http.HandlerFunc(
		func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusOK)
			s := newServerStream(w, r)
			s.flusher.Flush()
			buf := make([]byte, message)
			for {
				if _, err := io.ReadFull(s, buf); err != nil {
					return
				}
				if _, err := s.Write(buf); err != nil {
					return
				}
			}
		})})
	cc, err := newHBONETransport().NewClientConn(client)
	must(t, err)
	tunnel := openTestTunnel(t, cc)
	t.Cleanup(func() { tunnel.Close() })

	const messages = 64
	// Let the writes of the tunnel's opening (settings and their
	// acknowledgements; no routine updates) finish first.
	time.Sleep(50 * time.Millisecond)
	clientBefore, serverBefore := clientSide.writes.Load(), serverSide.writes.Load()
	req, resp := make([]byte, message), make([]byte, message)
	for i := range messages {
		req[0] = byte(i)
		if _, err := tunnel.Write(req); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(tunnel, resp); err != nil {
			t.Fatal(err)
		}
		if resp[0] != byte(i) {
			t.Fatalf("message %d came back as %d", i, resp[0])
		}
	}
	if n := serverSide.writes.Load() - serverBefore; n != messages {
		t.Errorf("the server wrote %d times for %d responses, want one write each", n, messages)
	}
	if n := clientSide.writes.Load() - clientBefore; n != messages {
		t.Errorf("the client wrote %d times for %d requests, want one write each", n, messages)
	}
	// The client's last update follows its last read: the timer sends it.
	eventually(t, func() bool { return clientSide.writes.Load()-clientBefore == messages+1 },
		"the client's last window update, sent by the timer")
}

// TestDeferredUpdatesKeepTheOrder: deferred updates leave before the next
// write, which may end inside a frame; the peer reads every frame whole.
// Closing while a write is blocked on a peer that does not read ends it at
// once.
func TestDeferredUpdatesKeepTheOrder(t *testing.T) {
	writerSide, readerSide := net.Pipe()
	t.Cleanup(func() { writerSide.Close(); readerSide.Close() })
	writer, reader := batchedPair(t, writerSide, readerSide, false)
	update := framed(func(f *http2.Framer) { f.WriteWindowUpdate(0, 4096); f.WriteWindowUpdate(3, 4096) })
	payload := bytes.Repeat([]byte("0123456789"), 300)
	data := framed(func(f *http2.Framer) { f.WriteData(3, false, payload) })

	wrote := make(chan error, 1)
	go func() {
		for _, w := range [][]byte{update, data[:20], data[20:]} {
			if _, err := writer.Write(w); err != nil {
				wrote <- err
				return
			}
		}
		wrote <- nil
	}()
	fr := http2.NewFramer(nil, reader.Conn)
	for _, want := range []uint32{0, 3} {
		frame, err := fr.ReadFrame()
		must(t, err)
		if u, ok := frame.(*http2.WindowUpdateFrame); !ok || u.StreamID != want || u.Increment != 4096 {
			t.Fatalf("read %v, want the update of stream %d first", frame, want)
		}
	}
	frame, err := fr.ReadFrame()
	must(t, err)
	if d, ok := frame.(*http2.DataFrame); !ok || !bytes.Equal(d.Data(), payload) {
		t.Fatalf("read %v, want the data whole", frame)
	}
	must(t, <-wrote)

	// Nothing reads any more: this write blocks in the pipe.
	go writer.Write(data)
	time.Sleep(50 * time.Millisecond)
	closed := make(chan error, 1)
	go func() { closed <- writer.Close() }()
	select {
	case <-closed:
	case <-time.After(3 * time.Second): // tls.Conn's close_notify would wait 5 s
		t.Fatal("Close waits behind a write blocked on the peer")
	}
}

// batchedPair is both ends of a TLS connection over a and b, each a
// batchedTLS, after the handshake; a is the HTTP/2 client if h2Client.
func batchedPair(t testing.TB, a, b net.Conn, h2Client bool) (*batchedTLS, *batchedTLS) {
	// The server's certificate: a CA root, as the node agent makes one.
	certPEM, keyPEM, err := identity.NewRootMaterial("cluster.local", time.Hour)
	must(t, err)
	cert, err := tls.X509KeyPair(certPEM, keyPEM)
	must(t, err)
	serverConfig := &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS13}
	client := newBatchedTLS(a, h2Client, func(c net.Conn) *tls.Conn {
		// Only the write path is under test here; hbone_test.go checks identities.
		return tls.Client(c, &tls.Config{InsecureSkipVerify: true, MinVersion: tls.VersionTLS13})
	})
	server := newBatchedTLS(b, false, func(c net.Conn) *tls.Conn { return tls.Server(c, serverConfig) })
	handshaken := make(chan error, 1)
	go func() { handshaken <- server.Handshake() }()
	must(t, client.Handshake())
	must(t, <-handshaken)
	return client, server
}

// message is the size of a request or response in the test above.
const message = 1 << 10

// countingConn counts the writes that reach the connection under TLS.
type countingConn struct {
	net.Conn
	writes atomic.Int64
}

func (c *countingConn) Write(p []byte) (int, error) {
	c.writes.Add(1)
	return c.Conn.Write(p)
}
