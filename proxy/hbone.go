// SPDX-License-Identifier: Apache-2.0

package proxy

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"sync"
	"time"

	"golang.org/x/net/http2"
)

// Bounds of HBONE, for what a peer controls.
const (
	handshakeTimeout = 10 * time.Second
	// connectTimeout bounds the wait for the answer to a CONNECT.
	connectTimeout = 10 * time.Second
	// maxHeaderBytes bounds an HBONE request's or response's headers.
	maxHeaderBytes = 16 << 10
	// maxStreamsPerConnection bounds concurrent CONNECTs on one
	// connection (peers such as ztunnel pool streams; ours use one).
	maxStreamsPerConnection = 100
	// h2IdleTimeout closes an HBONE connection without streams.
	h2IdleTimeout = 60 * time.Second
	// h2FrameSize is the largest frame each side accepts, HTTP/2's
	// initial size, and the largest our client sends whatever the server
	// allows: x/net's client holds a write buffer of that size for each
	// open tunnel, idle or not (frameSizeClamp; 64 KiB frames cost an idle
	// tunnel 48 KiB more).
	h2FrameSize = 16 << 10
	// maxHandshakesPerSource bounds the connections of one source address
	// not yet through their TLS handshake: a stranger holding idle
	// connections takes at most that many of the node's slots. A peer's
	// tunnels leave from their pods' addresses and are pooled, so a pod
	// has one handshake under way per destination pod of this node.
	maxHandshakesPerSource = 256
)

// newHBONETransport is the HTTP/2 client side: ClientConns made on the
// proxy's own TLS connections, shared by tunnels (tunnelPool), closing
// themselves after h2IdleTimeout without a stream.
func newHBONETransport() *http2.Transport {
	return &http2.Transport{
		IdleConnTimeout:    h2IdleTimeout,
		DisableCompression: true,
		MaxHeaderListSize:  maxHeaderBytes,
		MaxReadFrameSize:   h2FrameSize,
		ReadIdleTimeout:    30 * time.Second,
		PingTimeout:        10 * time.Second,
	}
}

// newHBONEServer is the HTTP/2 server side of port 15008.
func newHBONEServer() *http2.Server {
	return &http2.Server{
		MaxConcurrentStreams:         maxStreamsPerConnection,
		MaxReadFrameSize:             h2FrameSize,
		IdleTimeout:                  h2IdleTimeout,
		MaxUploadBufferPerStream:     4 << 20,
		MaxUploadBufferPerConnection: 8 << 20,
	}
}

// forwardedFor is the Forwarded header of a CONNECT, as ztunnel sends it:
// for="IP:PORT" of the application's connection.
func forwardedFor(src netip.AddrPort) string { return `for="` + src.String() + `"` }

// clientStream is an HBONE tunnel as one end of a relay: writes go into
// the CONNECT's request body, reads come from its response body. Closing
// it ends the stream, not the connection it shares with others.
type clientStream struct {
	body   io.ReadCloser
	pw     *io.PipeWriter
	cancel context.CancelFunc
}

func (s *clientStream) Read(p []byte) (int, error)  { return s.body.Read(p) }
func (s *clientStream) Write(p []byte) (int, error) { return s.pw.Write(p) }

// waitReadable returns once the response body has data, its end or an
// error, without a buffer (see waitBody).
func (s *clientStream) waitReadable() error { return waitBody(s.body) }

// CloseWrite ends the request body: END_STREAM.
func (s *clientStream) CloseWrite() error { return s.pw.Close() }

// Close resets the stream if it is still open.
func (s *clientStream) Close() error {
	s.cancel()
	s.pw.CloseWithError(net.ErrClosed)
	return s.body.Close()
}

// openTunnel sends CONNECT authority on an HBONE connection (on which the
// caller reserved a stream, or a new one) and returns the tunnel once the
// peer answered 200.
func openTunnel(cc *http2.ClientConn, authority string, forwarded string) (*clientStream, error) {
	pr, pw := io.Pipe()
	// The stream lives as long as the tunnel: its context ends at Close,
	// or at connectTimeout if no answer comes.
	ctx, cancel := context.WithCancel(context.Background())
	req := (&http.Request{
		Method:        http.MethodConnect,
		URL:           &url.URL{Host: authority},
		Host:          authority,
		Header:        http.Header{"Forwarded": {forwarded}},
		Body:          pr,
		ContentLength: -1,
		Proto:         "HTTP/2.0", ProtoMajor: 2,
	}).WithContext(ctx)
	answered := time.AfterFunc(connectTimeout, cancel)
	resp, err := cc.RoundTrip(req)
	answered.Stop()
	fail := func(err error) (*clientStream, error) {
		cancel()
		pw.CloseWithError(err)
		return nil, err
	}
	if err != nil {
		return fail(fmt.Errorf("CONNECT %s: %w", authority, err))
	}
	if resp.StatusCode != http.StatusOK {
		resp.Body.Close()
		return fail(fmt.Errorf("%w: CONNECT %s: %s", ErrTunnelRefused, authority, resp.Status))
	}
	return &clientStream{body: resp.Body, pw: pw, cancel: cancel}, nil
}

// serverStream is an accepted CONNECT as one end of a relay: reads come
// from the request body, writes go out as response DATA frames at once.
// The stream ends (END_STREAM) when the handler returns; writes after that
// fail instead of touching a finished ResponseWriter.
type serverStream struct {
	body    io.ReadCloser
	w       http.ResponseWriter
	flusher http.Flusher
	ctl     *http.ResponseController

	mu       sync.Mutex
	finished bool
}

func newServerStream(w http.ResponseWriter, r *http.Request) *serverStream {
	f, _ := w.(http.Flusher)
	return &serverStream{body: r.Body, w: w, flusher: f, ctl: http.NewResponseController(w)}
}

func (s *serverStream) Read(p []byte) (int, error) { return s.body.Read(p) }

// waitReadable returns once the request body has data, its end or an
// error, without a buffer (see waitBody).
func (s *serverStream) waitReadable() error { return waitBody(s.body) }

// waitBody waits on an HTTP/2 body with a read of nothing: x/net's bodies
// return from it only once data, the end or an error is there
// (TestStreamsWaitWithoutABuffer checks it), so an idle tunnel holds no
// copy buffer at either end. The end is for the read that follows.
func waitBody(body io.Reader) error {
	if _, err := body.Read(nil); err != nil && err != io.EOF {
		return err
	}
	return nil
}

// Write sends p to the client. Only the handler's goroutine writes (the
// relay's inline direction), so Write never races with finish.
func (s *serverStream) Write(p []byte) (int, error) {
	n, err := s.w.Write(p)
	if err == nil && s.flusher != nil {
		s.flusher.Flush()
	}
	return n, err
}

// CloseWrite does nothing: the handler's return is the stream's end.
func (s *serverStream) CloseWrite() error { return nil }

// Close aborts the stream: a write blocked on the client's flow control
// fails at once (the stream is reset), so the handler returns.
func (s *serverStream) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.finished {
		s.ctl.SetWriteDeadline(time.Unix(1, 0))
		s.body.Close()
	}
	return nil
}

// finish marks the handler done; call it before the handler returns.
func (s *serverStream) finish() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.finished = true
}
