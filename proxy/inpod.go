// SPDX-License-Identifier: Apache-2.0

package proxy

// In-pod mode (INPOD_UDS set), as ztunnel >= 1.23 runs: the node agent
// writes the redirection into each enrolled pod's network namespace and
// hands the namespace over ZDS; the proxy opens its listeners inside it
// and makes its connections from inside it, with its sockets marked
// PacketMark so that the pod's rules let them through:
//
//	15001  the pod's outbound TCP (REDIRECT; the original destination from
//	       SO_ORIGINAL_DST): HBONE to an HBONE workload of another node,
//	       plain from the pod otherwise, as in the l2 mode;
//	15006  plain inbound TCP to the pod (REDIRECT): Authorization applied,
//	       then delivered to the pod from the client's own address;
//	15008  HBONE inbound, exactly as in the l2 mode.
//
// The capture and HBONE code is the l2 mode's; only where sockets live
// changes. A pod a namespace brings is the one ZDS names (workload_info):
// a connection from its namespace counts as that pod's only.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"sync"
	"syscall"

	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
	"istio.io/istio/pkg/zdsapi"

	"github.com/mtlsbridge/mtlsbridge/internal/nsthread"
	"github.com/mtlsbridge/mtlsbridge/zds"
)

// PacketMark is ztunnel's PACKET_MARK (1337): the mark of the proxy's own
// sockets inside pods, which the in-pod rules never redirect.
const PacketMark = 0x539

// InboundPlainPort is ztunnel's plain inbound listener inside pods.
const InboundPlainPort = 15006

// inPodPod is a pod the proxy serves inside its namespace.
type inPodPod struct {
	uid   string
	info  *zdsapi.WorkloadInfo
	netns *os.File
	id    [2]uint64 // device and inode of the namespace
	// cancel ends its listeners' connections; listeners close first.
	cancel    context.CancelFunc
	listeners []net.Listener
	done      sync.WaitGroup
}

// inPod is the zds.Handler of the proxy: the pods it serves.
type inPod struct {
	p   *Proxy
	ctx context.Context

	mu   sync.Mutex
	pods map[string]*inPodPod
	// snapshot is closed at the first snapshot_sent: the pods the node
	// agent knows are all served (readiness waits for it, as ztunnel's).
	snapshot     chan struct{}
	snapshotOnce sync.Once
}

var _ zds.Handler = (*inPod)(nil)

func newInPod(ctx context.Context, p *Proxy) *inPod {
	return &inPod{p: p, ctx: ctx, pods: map[string]*inPodPod{}, snapshot: make(chan struct{})}
}

// Add implements zds.Handler: listeners in the pod's namespace. The same
// uid in the same namespace again changes nothing; in another, the old one
// goes first (the pod's sandbox was recreated).
func (m *inPod) Add(uid string, info *zdsapi.WorkloadInfo, f *os.File) error {
	id, err := nsID(f)
	if err != nil {
		f.Close()
		return err
	}
	m.mu.Lock()
	old := m.pods[uid]
	m.mu.Unlock()
	if old != nil && old.id == id {
		f.Close()
		return nil
	}
	if old != nil {
		m.Del(uid)
	}
	pod := &inPodPod{uid: uid, info: info, netns: f, id: id}
	if err := m.start(pod); err != nil {
		f.Close()
		return fmt.Errorf("pod %s/%s: %w", info.GetNamespace(), info.GetName(), err)
	}
	m.mu.Lock()
	m.pods[uid] = pod
	m.p.metrics.InPodPods.Set(float64(len(m.pods)))
	m.mu.Unlock()
	m.p.log.Info("Serving pod in its namespace", "uid", uid, "namespace", info.GetNamespace(), "name", info.GetName())
	return nil
}

// Del implements zds.Handler: the pod's listeners close at once, its
// connections end.
func (m *inPod) Del(uid string) {
	m.mu.Lock()
	pod := m.pods[uid]
	delete(m.pods, uid)
	m.p.metrics.InPodPods.Set(float64(len(m.pods)))
	m.mu.Unlock()
	if pod == nil {
		return
	}
	m.p.log.Info("Pod no longer served", "uid", uid, "namespace", pod.info.GetNamespace(), "name", pod.info.GetName())
	pod.stop()
}

// Reconcile implements zds.Handler.
func (m *inPod) Reconcile(keep map[string]bool) {
	m.mu.Lock()
	var gone []string
	for uid := range m.pods {
		if !keep[uid] {
			gone = append(gone, uid)
		}
	}
	m.mu.Unlock()
	for _, uid := range gone {
		m.Del(uid)
	}
	m.snapshotOnce.Do(func() { close(m.snapshot) })
}

// summary lists the pods served, by uid.
func (m *inPod) summary() []InPodSummary {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]InPodSummary, 0, len(m.pods))
	for uid, pod := range m.pods {
		out = append(out, InPodSummary{UID: uid, Namespace: pod.info.GetNamespace(), Name: pod.info.GetName(),
			ServiceAccount: pod.info.GetServiceAccount()})
	}
	slices.SortFunc(out, func(a, b InPodSummary) int { return strings.Compare(a.UID, b.UID) })
	return out
}

// stopAll ends every pod (the proxy stops).
func (m *inPod) stopAll() {
	m.mu.Lock()
	uids := slices.Collect(func(yield func(string) bool) {
		for uid := range m.pods {
			if !yield(uid) {
				return
			}
		}
	})
	m.mu.Unlock()
	for _, uid := range uids {
		m.Del(uid)
	}
}

// start opens the pod's listeners (both families; IPv6 only where the
// namespace has it) and serves them.
func (m *inPod) start(pod *inPodPod) error {
	ctx, cancel := context.WithCancel(m.ctx)
	pod.cancel = cancel
	p := m.p
	for _, l := range []struct {
		port      int
		slots     chan struct{}
		direction string
		handle    func(context.Context, *net.TCPConn)
	}{
		{OutboundPort, p.outboundSlots, DirectionOutbound, func(ctx context.Context, c *net.TCPConn) {
			dst, err := originalDst(c)
			if err != nil {
				p.refuse(DirectionOutbound, "no-original-destination", addrPort(c.RemoteAddr()), addrPort(c.LocalAddr()), "", "", err)
				reset(c)
				return
			}
			p.outbound(ctx, c, addrPort(c.RemoteAddr()), dst, pod, pod.dial)
		}},
		{InboundPlainPort, p.inboundSlots, DirectionInbound, func(ctx context.Context, c *net.TCPConn) { p.inboundPlain(ctx, c, pod) }},
		{HBONEPort, p.inboundSlots, DirectionInbound, func(ctx context.Context, c *net.TCPConn) { p.inbound(ctx, c, pod.dial) }},
	} {
		for _, family := range []string{"tcp4", "tcp6"} {
			addr := fmt.Sprintf("0.0.0.0:%d", l.port)
			if family == "tcp6" {
				addr = fmt.Sprintf("[::]:%d", l.port)
			}
			ln, err := pod.listen(family, addr)
			if err != nil && family == "tcp6" && (errors.Is(err, syscall.EADDRNOTAVAIL) || errors.Is(err, syscall.EAFNOSUPPORT)) {
				continue // a namespace without IPv6
			}
			if err != nil {
				pod.stop()
				return fmt.Errorf("listen %s in the pod: %w", addr, err)
			}
			pod.listeners = append(pod.listeners, ln)
			pod.done.Add(1)
			go func() {
				defer pod.done.Done()
				p.accept(ctx, ln, l.slots, l.direction, l.handle)
			}()
		}
	}
	return nil
}

// stop closes the listeners, ends the connections and releases the
// namespace once they are gone.
func (pod *inPodPod) stop() {
	for _, l := range pod.listeners {
		l.Close()
	}
	pod.cancel()
	go func() {
		pod.done.Wait()
		pod.netns.Close()
	}()
}

// listen opens a listener inside the pod's namespace, marked as the
// proxy's (and SO_REUSEPORT, as ztunnel's, so that a replacing proxy can
// bind beside one that drains).
func (pod *inPodPod) listen(network, addr string) (net.Listener, error) {
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		err := c.Control(func(fd uintptr) {
			serr = errors.Join(unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK, PacketMark),
				unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEPORT, 1))
		})
		return errors.Join(err, serr)
	}}
	var l net.Listener
	err := inNetns(pod.netns, func() (err error) {
		l, err = lc.Listen(context.Background(), network, addr)
		return err
	})
	return l, err
}

// dial connects from inside the pod's namespace, marked as the proxy's,
// with src as source (the pod's own address outbound; the client's,
// transparently, when delivering to the pod).
func (pod *inPodPod) dial(ctx context.Context, src netip.Addr, dst netip.AddrPort) (*net.TCPConn, error) {
	d := net.Dialer{Timeout: dialTimeout, Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		err := c.Control(func(fd uintptr) {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK, PacketMark)
		})
		if err == nil && serr == nil && src.IsValid() {
			return setTransparent(c, src.Is6())
		}
		return errors.Join(err, serr)
	}}
	if src.IsValid() {
		d.LocalAddr = net.TCPAddrFromAddrPort(netip.AddrPortFrom(src, 0))
	}
	network := "tcp4"
	if dst.Addr().Is6() {
		network = "tcp6"
	}
	var c net.Conn
	err := inNetns(pod.netns, func() (err error) {
		c, err = d.DialContext(ctx, network, dst.String())
		return err
	})
	if err != nil {
		return nil, err
	}
	return c.(*net.TCPConn), nil
}

// inboundPlain serves plain TCP redirected to 15006 in a pod: a client
// that is not in the mesh (or the node). Authorization applies with no
// source identity; then the connection goes to the pod from the client's
// own address, so that the pod (and Cilium's policy) see the client.
func (p *Proxy) inboundPlain(ctx context.Context, conn *net.TCPConn, pod *inPodPod) {
	src := addrPort(conn.RemoteAddr())
	dst, err := originalDst(conn)
	if err != nil {
		p.refuse(DirectionInbound, "no-original-destination", src, addrPort(conn.LocalAddr()), "", "", err)
		reset(conn)
		return
	}
	if ownPort(dst.Port()) {
		p.refuse(DirectionInbound, "loop", src, dst, "", "", fmt.Errorf("%w: %s is a port of the proxy's own", ErrLoop, dst))
		reset(conn)
		return
	}
	if !p.awaitSynced(ctx, conn, DirectionInbound, src, dst) {
		return
	}
	dstW := p.state.LocalByIP(dst.Addr())
	if dstW == nil || dstW.Name != pod.info.GetName() || dstW.Namespace != pod.info.GetNamespace() {
		p.refuse(DirectionInbound, "unknown-destination", src, dst, "", "",
			fmt.Errorf("%w: %s is not %s/%s's", ErrBadRequest, dst.Addr(), pod.info.GetNamespace(), pod.info.GetName()))
		reset(conn)
		return
	}
	connection := Connection{Source: src, Destination: dst}
	ctx, done := p.live.add(ctx, dstW, connection)
	defer done()
	if d := Authorize(p.state.Policies(dstW), connection); !d.Allowed {
		p.refuse(DirectionInbound, "denied", src, dst, "", dstW.Identity, fmt.Errorf("%w: %s", ErrDenied, orNone(d.Policy)))
		reset(conn)
		return
	}
	up, err := pod.dial(ctx, src.Addr(), dst)
	if err != nil {
		p.refuse(DirectionInbound, "connect-failed", src, dst, "", dstW.Identity, err)
		reset(conn)
		return
	}
	p.opened(DirectionInbound, ProtocolPlain, src, dst, "", dstW.Identity)
	res := relay(ctx, p.bufs, newTCPStream(conn), newTCPStream(up), p.counters(DirectionInbound, ProtocolPlain))
	p.closed(DirectionInbound, ProtocolPlain, src, dst, res)
}

// inNetns runs fn on an OS thread of its own in the namespace f; the
// sockets fn makes live there. fn may block (a connect).
func inNetns(f *os.File, fn func() error) error {
	return nsthread.Do(netns.NsHandle(f.Fd()), fn)
}

// nsID identifies a namespace by its device and inode.
func nsID(f *os.File) ([2]uint64, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return [2]uint64{}, err
	}
	return [2]uint64{st.Dev, st.Ino}, nil
}
