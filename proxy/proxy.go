// SPDX-License-Identifier: Apache-2.0

package proxy

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"golang.org/x/net/http2"

	"github.com/mtlsbridge/mtlsbridge/zds"
)

// maxConnections bounds the connections held per direction; beyond it new
// ones are refused (reset) and counted.
const maxConnections = 16384

// Proxy is the node's mTLS agent.
type Proxy struct {
	cfg      Config
	log      *slog.Logger
	metrics  *Metrics
	registry *prometheus.Registry

	state *State
	xds   *XDS
	certs *Certificates
	// inpod serves the pods' namespaces in the in-pod mode; nil otherwise.
	inpod *inPod

	transport *http2.Transport
	pool      *tunnelPool
	h2        *http2.Server
	bufs      *buffers
	// live are the inbound connections, rechecked at policy changes.
	live *liveConns
	// handshakes counts inbound connections not through their handshake,
	// by source address.
	handshakes *perSource

	// peerHBONEPort is where peers' HBONE listeners are (15008; tests
	// move it).
	peerHBONEPort uint16

	outboundSlots, inboundSlots chan struct{}
	ready                       atomic.Bool
	// readyCh is closed when the proxy becomes ready.
	readyCh chan struct{}
	// syncWait: see awaitSynced.
	syncWait time.Duration
}

// New builds a proxy from a validated configuration; Run starts it.
func New(cfg Config, log *slog.Logger) *Proxy {
	cfg = cfg.withDefaults()
	reg := prometheus.NewRegistry()
	// The Go runtime's and the process's own, as any Prometheus endpoint.
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	m := NewMetrics(reg)
	state := NewState(cfg.NodeName)
	return &Proxy{
		cfg: cfg, log: log, metrics: m, registry: reg,
		state:         state,
		xds:           NewXDS(cfg, state, m, log),
		certs:         NewCertificates(cfg, state, m, log),
		transport:     newHBONETransport(),
		pool:          newTunnelPool(),
		live:          newLiveConns(),
		handshakes:    newPerSource(maxHandshakesPerSource),
		h2:            newHBONEServer(),
		bufs:          newBuffers(),
		peerHBONEPort: HBONEPort,
		outboundSlots: make(chan struct{}, maxConnections),
		inboundSlots:  make(chan struct{}, maxConnections),
		readyCh:       make(chan struct{}),
		syncWait:      syncWait,
	}
}

// syncWait bounds how long a connection that comes before xDS is synced
// waits for it (the proxy's start, usually milliseconds) before it is
// reset.
const syncWait = 5 * time.Second

// awaitSynced holds a captured connection from src to dst until xDS is
// synced: what it is sent (a tunnel, plain TCP, refused) is decided on the
// node agent's whole view, never on part of a snapshot. If that does not
// come, the connection is refused (reset, logged, counted) and it reports
// false.
func (p *Proxy) awaitSynced(ctx context.Context, conn *net.TCPConn, direction string, src, dst netip.AddrPort) bool {
	select {
	case <-p.xds.Synced():
		return true
	default:
	}
	t := time.NewTimer(p.syncWait)
	defer t.Stop()
	select {
	case <-p.xds.Synced():
		return true
	case <-ctx.Done():
	case <-t.C:
	}
	p.refuse(direction, "not-synced", src, dst, "", "", ErrNotSynced)
	reset(conn)
	return false
}

// State is what xDS told the proxy.
func (p *Proxy) State() *State { return p.state }

// Certificates are the workload certificates held.
func (p *Proxy) Certificates() *Certificates { return p.certs }

// Registry holds the proxy's metrics.
func (p *Proxy) Registry() *prometheus.Registry { return p.registry }

// Ready is closed once xDS is synced and every local workload's
// certificate is held (readiness latches, as ztunnel's).
func (p *Proxy) Ready() <-chan struct{} { return p.readyCh }

// Run opens the listeners, installs the capture and serves until ctx
// ends; then it removes the capture and closes the listeners. In-flight
// connections are closed too.
func (p *Proxy) Run(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var listeners []net.Listener
	defer func() {
		for _, l := range listeners {
			l.Close()
		}
	}()
	open := func(addrs []string) ([]net.Listener, error) {
		var out []net.Listener
		for _, a := range addrs {
			l, err := listenTransparent(ctx, a)
			if errors.Is(err, syscall.EADDRNOTAVAIL) && isIPv6(a) {
				// A namespace without IPv6 (no ::1): IPv4 only.
				p.log.Warn("No IPv6 listener", "address", a, "error", err)
				continue
			}
			if err != nil {
				return nil, fmt.Errorf("listen %s: %w", a, err)
			}
			listeners = append(listeners, l)
			out = append(out, l)
		}
		return out, nil
	}
	// In-pod mode: the listeners are in the pods' namespaces, opened as
	// ZDS hands them over; nothing is captured here.
	var outbound, inbound []net.Listener
	var err error
	if p.cfg.InPodUDS == "" {
		if outbound, err = open(p.cfg.OutboundListen); err != nil {
			return err
		}
		if inbound, err = open(p.cfg.HBONEListen); err != nil {
			return err
		}
	}
	health, err := p.serveHealth(ctx)
	if err != nil {
		return err
	}
	defer health()

	if p.cfg.Capture && p.cfg.InPodUDS == "" {
		c, err := InstallCapture(CaptureOptions{})
		if err != nil {
			return fmt.Errorf("capture: %w", err)
		}
		p.log.Info("Capture installed", "table", c.Table(), "mark", fmt.Sprintf("%#x", c.opts.Mark), "routeTable", c.opts.RouteTable)
		defer func() {
			if err := c.Remove(); err != nil {
				p.log.Error("Removing the capture", "error", err)
			}
		}()
	}

	var wg sync.WaitGroup
	run := func(fn func()) {
		wg.Add(1)
		go func() { defer wg.Done(); fn() }()
	}
	run(func() { p.xds.Run(ctx) })
	run(func() { p.certs.Run(ctx) })
	fatal := make(chan error, 1)
	if p.cfg.InPodUDS != "" {
		p.inpod = newInPod(ctx, p)
		defer p.inpod.stopAll()
		run(func() {
			c := &zds.Client{Path: p.cfg.InPodUDS, Handler: p.inpod, Log: p.log, MaxBackoff: zdsMaxBackoff,
				Connected: func(int) { p.metrics.ZDSConnects.Inc() }}
			// As ztunnel: a node agent that breaks the protocol stops
			// the proxy.
			if err := c.Run(ctx); err != nil {
				fatal <- err
				cancel()
			}
		})
	}
	run(func() { p.watchReadiness(ctx) })
	run(func() { p.sweepTunnels(ctx) })
	run(func() { p.enforcePolicies(ctx) })
	for _, l := range outbound {
		run(func() { p.accept(ctx, l, p.outboundSlots, DirectionOutbound, p.handleOutbound) })
	}
	for _, l := range inbound {
		run(func() { p.accept(ctx, l, p.inboundSlots, DirectionInbound, p.handleInbound) })
	}
	if p.cfg.InPodUDS != "" {
		p.log.Info("Proxy started in the in-pod mode", "node", p.cfg.NodeName, "xds", p.cfg.XDSAddress, "ca", p.cfg.CAAddress,
			"zds", p.cfg.InPodUDS)
	} else {
		p.log.Info("Proxy started", "node", p.cfg.NodeName, "xds", p.cfg.XDSAddress, "ca", p.cfg.CAAddress,
			"outbound", p.cfg.OutboundListen, "hbone", p.cfg.HBONEListen, "capture", p.cfg.Capture)
	}
	<-ctx.Done()
	for _, l := range listeners {
		l.Close()
	}
	if p.inpod != nil {
		p.inpod.stopAll()
	}
	p.pool.closeAll()
	wg.Wait()
	p.log.Info("Proxy stopped")
	select {
	case err := <-fatal:
		return fmt.Errorf("zds: %w", err)
	default:
		return nil
	}
}

// zdsMaxBackoff bounds the wait between attempts to reach the node
// agent's ZDS socket (ztunnel's: 15s): the reference agent comes back
// within a second of a node agent restart.
const zdsMaxBackoff = time.Second

// accept serves a listener, one goroutine per connection, at most
// maxConnections at a time per direction.
func (p *Proxy) accept(ctx context.Context, l net.Listener, slots chan struct{}, direction string, handle func(context.Context, *net.TCPConn)) {
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		c, err := l.Accept()
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return
			}
			p.log.Warn("Accept failed", "listener", l.Addr(), "error", err)
			select {
			case <-ctx.Done():
				return
			case <-time.After(50 * time.Millisecond):
			}
			continue
		}
		tc := c.(*net.TCPConn)
		select {
		case slots <- struct{}{}:
		default:
			p.refuse(direction, "overloaded", addrPort(c.RemoteAddr()), addrPort(c.LocalAddr()), "", "", ErrOverloaded)
			reset(tc)
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-slots }()
			handle(ctx, tc)
		}()
	}
}

// watchReadiness closes readyCh once xDS synced and the certificates of
// every local workload are held.
func (p *Proxy) watchReadiness(ctx context.Context) {
	select {
	case <-ctx.Done():
		return
	case <-p.xds.Synced():
	}
	if p.inpod != nil {
		// As ztunnel: ready once the node agent's snapshot is served.
		select {
		case <-ctx.Done():
			return
		case <-p.inpod.snapshot:
		}
	}
	for {
		certsChanged, stateChanged := p.certs.Changed(), p.state.Changed()
		if p.certs.HoldsAll() {
			p.ready.Store(true)
			close(p.readyCh)
			p.log.Info("Proxy ready", "certificates", p.certs.Identities())
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-certsChanged:
		case <-stateChanged:
		}
	}
}

// sweepTunnels drops closed HBONE connections from the pool now and then.
func (p *Proxy) sweepTunnels(ctx context.Context) {
	t := time.NewTicker(h2IdleTimeout / 2)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			p.pool.sweep()
		}
	}
}

// refuse counts and logs a connection the proxy refuses or cannot
// complete: one line naming both ends and both identities.
func (p *Proxy) refuse(direction, reason string, src, dst netip.AddrPort, srcID, dstID string, err error) {
	p.metrics.Refused.WithLabelValues(direction, reason).Inc()
	p.log.Warn("Refused connection", "direction", direction, "reason", reason,
		"source", src, "destination", dst, "sourceIdentity", srcID, "destinationIdentity", dstID, "error", err)
}

// opened and closed count and log a proxied connection.
func (p *Proxy) opened(direction, protocol string, src, dst netip.AddrPort, srcID, dstID string) {
	p.metrics.ConnectionsOpened.WithLabelValues(direction, protocol).Inc()
	p.log.Info("Connection opened", "direction", direction, "protocol", protocol,
		"source", src, "destination", dst, "sourceIdentity", srcID, "destinationIdentity", dstID)
}

func (p *Proxy) closed(direction, protocol string, src, dst netip.AddrPort, res relayResult) {
	p.metrics.ConnectionsClosed.WithLabelValues(direction, protocol).Inc()
	p.log.Info("Connection closed", "direction", direction, "protocol", protocol,
		"source", src, "destination", dst, "sent", res.Sent, "received", res.Received, "error", res.Err)
}

// counters returns the byte counters of a direction and protocol.
func (p *Proxy) counters(direction, protocol string) relayOptions {
	sent := p.metrics.SentBytes.WithLabelValues(direction, protocol)
	received := p.metrics.ReceivedBytes.WithLabelValues(direction, protocol)
	return relayOptions{
		idle:     p.cfg.IdleTimeout,
		sent:     func(n int) { sent.Add(float64(n)) },
		received: func(n int) { received.Add(float64(n)) },
	}
}

// reset closes a connection with RST: the application sees a refusal, not
// an orderly end.
func reset(c *net.TCPConn) {
	c.SetLinger(0)
	c.Close()
}

func isIPv6(hostport string) bool {
	ap, err := netip.ParseAddrPort(hostport)
	return err == nil && ap.Addr().Is6()
}
