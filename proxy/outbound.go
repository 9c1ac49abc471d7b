// SPDX-License-Identifier: Apache-2.0

package proxy

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/netip"

	"golang.org/x/net/http2"
)

// handleOutbound serves a connection captured from a local pod: its remote
// address is the pod's, its local address the original destination.
//
// The path follows what xDS says of the destination: a workload of another
// node whose tunnel protocol is HBONE is reached through HBONE, with the
// source workload's certificate, and only if the peer proves the
// destination's identity; anything else gets plain TCP from the pod's own
// address. An HBONE destination never falls back to plain TCP: without a
// certificate, a handshake, the right peer identity or a 200 answer, the
// pod's connection is reset.
func (p *Proxy) handleOutbound(ctx context.Context, conn *net.TCPConn) {
	p.outbound(ctx, conn, addrPort(conn.RemoteAddr()), addrPort(conn.LocalAddr()), nil, dialFrom)
}

// outbound serves a connection from src to dst; dial connects in the
// pod's name. In-pod, pod is the pod whose namespace the connection came
// from: the source workload must be that pod (a pod that took another's
// address gets no certificate of the other).
func (p *Proxy) outbound(ctx context.Context, conn *net.TCPConn, src, dst netip.AddrPort, pod *inPodPod, dial dialer) {
	if !p.awaitSynced(ctx, conn, DirectionOutbound, src, dst) {
		return
	}
	srcW := p.state.LocalByIP(src.Addr())
	if srcW == nil {
		p.refuse(DirectionOutbound, "unknown-source", src, dst, "", "", ErrUnknownSource)
		reset(conn)
		return
	}
	if pod != nil && (srcW.Name != pod.info.GetName() || srcW.Namespace != pod.info.GetNamespace()) {
		p.refuse(DirectionOutbound, "source-mismatch", src, dst, srcW.Identity, "",
			fmt.Errorf("%w: %s is %s/%s's address, the connection comes from %s/%s's namespace", ErrUnknownSource,
				src.Addr(), srcW.Namespace, srcW.Name, pod.info.GetNamespace(), pod.info.GetName()))
		reset(conn)
		return
	}
	// In-pod, a local mesh pod's address on the proxy's ports is the
	// proxy's listener in that pod.
	if local := p.state.LocalByIP(dst.Addr()); p.isSelf(dst.Addr()) || ownPort(dst.Port()) && local != nil && local.HBONE {
		p.refuse(DirectionOutbound, "loop", src, dst, srcW.Identity, "", ErrLoop)
		reset(conn)
		return
	}
	dstW := p.state.ByIP(dst.Addr())
	if dstW != nil && dstW.HBONE && dstW.Node != p.cfg.NodeName {
		p.outboundHBONE(ctx, conn, src, dst, srcW, dstW, dial)
		return
	}
	p.outboundPlain(ctx, conn, src, dst, srcW, dial)
}

func (p *Proxy) outboundHBONE(ctx context.Context, conn *net.TCPConn, src, dst netip.AddrPort, srcW, dstW *Workload, dial dialer) {
	refuse := func(reason string, err error) {
		p.refuse(DirectionOutbound, reason, src, dst, srcW.Identity, dstW.Identity, err)
		reset(conn)
	}
	cert := p.certs.Get(srcW.Identity)
	if cert == nil {
		refuse("no-certificate", ErrNoCertificate)
		return
	}
	key := tunnelKey{src: src.Addr(), dst: dst.Addr(), srcID: srcW.Identity, dstID: dstW.Identity}
	var stream *clientStream
	var err error
	// A stream on a pooled connection first (its peer proved key.dstID
	// when it was made); if that connection died meanwhile, a new one.
	c := p.pool.reserve(key)
	if c.cc != nil {
		stream, err = openTunnel(c.cc, dst.String(), forwardedFor(src))
		if err != nil && !errors.Is(err, ErrTunnelRefused) {
			c.cc.SetDoNotReuse()
			stream, err = nil, nil
		}
	}
	if stream == nil && err == nil {
		var ok bool
		if c, ok = p.dialTunnel(ctx, conn, src, dst, srcW, dstW, cert, dial); !ok {
			return
		}
		p.pool.add(key, c)
		stream, err = openTunnel(c.cc, dst.String(), forwardedFor(src))
	}
	if err != nil {
		refuse("tunnel-refused", err)
		return
	}
	p.opened(DirectionOutbound, ProtocolHBONE, src, dst, srcW.Identity, c.proved)
	res := relay(ctx, p.bufs, newTCPStream(conn), stream, p.counters(DirectionOutbound, ProtocolHBONE))
	p.closed(DirectionOutbound, ProtocolHBONE, src, dst, res)
}

// dialTunnel opens a new HBONE connection for a tunnel from src to dst: TCP
// from the source pod's address to the destination's port 15008, then TLS
// 1.3 where the peer must prove dstW's identity. A failure is refused
// (the pod's connection reset, logged with both identities, counted).
func (p *Proxy) dialTunnel(ctx context.Context, conn *net.TCPConn, src, dst netip.AddrPort, srcW, dstW *Workload, cert *tls.Certificate, dial dialer) (pooledConn, bool) {
	// The tunnel leaves from the pod's address, as ztunnel's does from
	// inside the pod: the peer proxy sees the pod as the source, and
	// Cilium's policy at the destination node sees the pod's identity.
	tcp, err := dial(ctx, src.Addr(), netip.AddrPortFrom(dst.Addr(), p.peerHBONEPort))
	if err != nil {
		p.refuse(DirectionOutbound, "connect-failed", src, dst, srcW.Identity, dstW.Identity, err)
		reset(conn)
		return pooledConn{}, false
	}
	p.metrics.TunnelsDialed.Inc()
	var proved string
	tlsConn := newBatchedTLS(tcp, true, func(c net.Conn) *tls.Conn {
		return tls.Client(c, clientTLS(cert, p.certs.Bundle(), p.cfg.TrustDomain, dstW.Identity, &proved))
	})
	hctx, cancel := context.WithTimeout(ctx, handshakeTimeout)
	err = tlsConn.HandshakeContext(hctx)
	cancel()
	var cc *http2.ClientConn
	if err == nil {
		cc, err = p.transport.NewClientConn(tlsConn)
	}
	if err != nil {
		tlsConn.Close()
		reason := handshakeReason(err)
		p.metrics.HandshakeFailures.WithLabelValues(DirectionOutbound, reason).Inc()
		p.refuse(DirectionOutbound, reason, src, dst, srcW.Identity, dstW.Identity+provedSuffix(proved), err)
		reset(conn)
		return pooledConn{}, false
	}
	return pooledConn{cc: cc, proved: proved}, true
}

func (p *Proxy) outboundPlain(ctx context.Context, conn *net.TCPConn, src, dst netip.AddrPort, srcW *Workload, dial dialer) {
	up, err := dial(ctx, src.Addr(), dst)
	if err != nil {
		p.refuse(DirectionOutbound, "connect-failed", src, dst, srcW.Identity, "", err)
		reset(conn)
		return
	}
	p.opened(DirectionOutbound, ProtocolPlain, src, dst, srcW.Identity, "")
	res := relay(ctx, p.bufs, newTCPStream(conn), newTCPStream(up), p.counters(DirectionOutbound, ProtocolPlain))
	p.closed(DirectionOutbound, ProtocolPlain, src, dst, res)
}

// isSelf: an address of the proxy's own (a loop through its listeners).
func (p *Proxy) isSelf(ip netip.Addr) bool {
	if ip.IsLoopback() || ip.IsUnspecified() {
		return true
	}
	own, err := netip.ParseAddr(p.cfg.InstanceIP)
	return err == nil && own == ip
}

// handshakeReason labels a failed handshake for metrics.
func handshakeReason(err error) string {
	var alert tls.AlertError
	switch {
	case errors.Is(err, ErrPeerIdentity):
		return "identity-mismatch"
	case errors.Is(err, ErrPeerCertificate):
		return "bad-certificate"
	case errors.Is(err, ErrNoCertificate):
		return "no-certificate"
	case errors.Is(err, context.DeadlineExceeded):
		return "timeout"
	case errors.As(err, &alert):
		return "peer-refused"
	}
	return "handshake-error"
}

func provedSuffix(proved string) string {
	if proved == "" {
		return ""
	}
	return " (peer proved " + proved + ")"
}
