// SPDX-License-Identifier: Apache-2.0

package proxy

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"net/http"
	"net/netip"

	"golang.org/x/net/http2"
)

// handleInbound serves an HBONE connection steered to port 15008 of a
// local pod: its local address is the pod's, its remote address the peer
// proxy's connection, which leaves from the source pod's address.
//
// The connection is addressed to one local workload; TLS answers with that
// workload's certificate and requires a client certificate of the trust
// domain. Each CONNECT is then checked (serveConnect) before plain TCP
// goes to the pod from the source pod's address.
func (p *Proxy) handleInbound(ctx context.Context, conn *net.TCPConn) {
	p.inbound(ctx, conn, dialFrom)
}

// inbound serves an HBONE connection; dial connects to the pod in the
// source's name.
func (p *Proxy) inbound(ctx context.Context, conn *net.TCPConn, dial dialer) {
	local, peer := addrPort(conn.LocalAddr()), addrPort(conn.RemoteAddr())
	handshaken, ok := p.handshakes.take(peer.Addr())
	if !ok {
		p.refuse(DirectionInbound, "source-overloaded", peer, local, "", "",
			fmt.Errorf("%w: %d handshakes under way from %s", ErrOverloaded, maxHandshakesPerSource, peer.Addr()))
		reset(conn)
		return
	}
	defer handshaken()
	if !p.awaitSynced(ctx, conn, DirectionInbound, peer, local) {
		return
	}
	dstW := p.state.LocalByIP(local.Addr())
	if dstW == nil {
		p.refuse(DirectionInbound, "unknown-destination", peer, local, "", "", fmt.Errorf("%w: %s is no local workload", ErrBadRequest, local.Addr()))
		reset(conn)
		return
	}
	var proved string
	cert := func() (*tls.Certificate, error) {
		if c := p.certs.Get(dstW.Identity); c != nil {
			return c, nil
		}
		return nil, fmt.Errorf("%w: %s", ErrNoCertificate, dstW.Identity)
	}
	tlsConn := newBatchedTLS(conn, false, func(c net.Conn) *tls.Conn {
		return tls.Server(c, serverTLS(cert, p.certs.Bundle, p.cfg.TrustDomain, &proved))
	})
	hctx, cancel := context.WithTimeout(ctx, handshakeTimeout)
	err := tlsConn.HandshakeContext(hctx)
	cancel()
	if err == nil && tlsConn.ConnectionState().NegotiatedProtocol != alpnH2 {
		err = fmt.Errorf("%w: ALPN %q, want h2", ErrBadRequest, tlsConn.ConnectionState().NegotiatedProtocol)
	}
	if err != nil {
		reason := handshakeReason(err)
		if p.certs.Get(dstW.Identity) == nil {
			reason = "no-certificate"
		}
		p.metrics.HandshakeFailures.WithLabelValues(DirectionInbound, reason).Inc()
		p.refuse(DirectionInbound, reason, peer, local, proved, dstW.Identity, err)
		tlsConn.Close()
		return
	}
	defer tlsConn.Close()
	// Peers keep their HBONE connections for reuse: a proxy that stops,
	// or a pod no longer served, closes them rather than wait.
	defer context.AfterFunc(ctx, func() { tlsConn.Close() })()
	handshaken()
	p.h2.ServeConn(tlsConn, &http2.ServeConnOpts{
		Context:    ctx,
		BaseConfig: &http.Server{MaxHeaderBytes: maxHeaderBytes},
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			p.serveConnect(ctx, w, r, dstW, proved, peer, dial)
		}),
	})
}

// serveConnect checks one CONNECT and relays it: the method is CONNECT;
// the authority is an address of the workload the certificate was chosen
// for, still this node's; the source address (the connection's peer) is
// held by a workload whose identity is the one the client proved, so that
// a mesh peer cannot borrow another pod's address; the Authorization
// policies allow it. Then plain TCP goes to the pod, from that source
// address: the pod, and Cilium's ingress policy, see the real peer.
func (p *Proxy) serveConnect(ctx context.Context, w http.ResponseWriter, r *http.Request, dstW *Workload, srcID string, peer netip.AddrPort, dial dialer) {
	target, err := netip.ParseAddrPort(r.Host)
	target = netip.AddrPortFrom(target.Addr().Unmap(), target.Port())
	refuse := func(code int, reason string, err error) {
		p.refuse(DirectionInbound, reason, peer, target, srcID, dstW.Identity, err)
		http.Error(w, reason, code)
	}
	switch {
	case r.Method != http.MethodConnect:
		refuse(http.StatusMethodNotAllowed, "not-connect", fmt.Errorf("%w: method %s", ErrBadRequest, r.Method))
		return
	case err != nil:
		refuse(http.StatusBadRequest, "bad-authority", fmt.Errorf("%w: authority %q: %v", ErrBadRequest, r.Host, err))
		return
	case ownPort(target.Port()):
		refuse(http.StatusBadRequest, "loop", fmt.Errorf("%w: %s is a port of the proxy's own", ErrLoop, target))
		return
	case !dstW.HasAddress(target.Addr()) || p.state.LocalByIP(target.Addr()) == nil || p.state.LocalByIP(target.Addr()).UID != dstW.UID:
		refuse(http.StatusBadRequest, "authority-mismatch", fmt.Errorf("%w: %s is not an address of %s, the workload this connection's certificate is for",
			ErrBadRequest, target, dstW.UID))
		return
	}
	srcW := p.state.ByIP(peer.Addr())
	if srcW == nil || srcW.Identity != srcID {
		holder := "no workload"
		if srcW != nil {
			holder = srcW.UID + " (" + srcW.Identity + ")"
		}
		refuse(http.StatusForbidden, "source-identity-mismatch", fmt.Errorf("%w: %s connects from %s, held by %s", ErrPeerIdentity, srcID, peer.Addr(), holder))
		return
	}
	conn := Connection{Source: peer, Destination: target, SourceIdentity: srcID}
	ctx, done := p.live.add(ctx, dstW, conn)
	defer done()
	if d := Authorize(p.state.Policies(dstW), conn); !d.Allowed {
		refuse(http.StatusForbidden, "denied", fmt.Errorf("%w: %s", ErrDenied, orNone(d.Policy)))
		return
	}
	up, err := dial(ctx, peer.Addr(), target)
	if err != nil {
		refuse(http.StatusServiceUnavailable, "connect-failed", err)
		return
	}
	w.WriteHeader(http.StatusOK)
	stream := newServerStream(w, r)
	if stream.flusher != nil {
		stream.flusher.Flush()
	}
	p.opened(DirectionInbound, ProtocolHBONE, peer, target, srcID, dstW.Identity)
	opts := p.counters(DirectionInbound, ProtocolHBONE)
	opts.returnOnReceivedEOF = true
	res := relay(ctx, p.bufs, stream, newTCPStream(up), opts)
	stream.finish()
	p.closed(DirectionInbound, ProtocolHBONE, peer, target, res)
}

func orNone(policy string) string {
	if policy == "" {
		return "no ALLOW policy matches"
	}
	return policy
}
