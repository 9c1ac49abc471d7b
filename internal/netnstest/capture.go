// SPDX-License-Identifier: Apache-2.0

package netnstest

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net/netip"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/gopacket"
	"github.com/google/gopacket/layers"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// MaxSegments bounds what one Capture keeps; later segments are only
// counted (Capture.Dropped).
const MaxSegments = 1 << 20

// captureBuf holds one frame. veth passes GSO/GRO super-packets of up to
// 64 KiB whole to packet sockets; a larger frame (BIG TCP) is cut short and
// its Payload counts only the bytes read.
const captureBuf = 1 << 17

// Segment is one TCP segment seen on a captured interface. With offloads
// (veth GRO/TSO) one Segment may stand for several on the wire.
type Segment struct {
	Time time.Time
	// Outgoing: sent through the interface by its namespace
	// (PACKET_OUTGOING); otherwise received on it.
	Outgoing           bool
	Src, Dst           netip.AddrPort
	SYN, FIN, RST, ACK bool
	// Payload is the number of TCP payload bytes.
	Payload int
	// Head is the payload's first bytes (up to HeadSize): enough to tell
	// a TLS record (content type, version) from anything else.
	Head []byte
	// Marked is set when the payload holds a marker given to Watch.
	Marked bool
	marker []byte
}

// HeadSize is how many payload bytes a Segment keeps.
const HeadSize = 5

func (s Segment) String() string {
	var flags []string
	for _, f := range []struct {
		on   bool
		name string
	}{{s.SYN, "SYN"}, {s.FIN, "FIN"}, {s.RST, "RST"}, {s.ACK, "ACK"}} {
		if f.on {
			flags = append(flags, f.name)
		}
	}
	dir := "in"
	if s.Outgoing {
		dir = "out"
	}
	marked := ""
	if s.Marked {
		marked = " MARKED"
	}
	return fmt.Sprintf("%s %s %s > %s [%s] len %d head %x%s", s.Time.Format("15:04:05.000000"), dir, s.Src, s.Dst,
		strings.Join(flags, ","), s.Payload, s.Head, marked)
}

// Capture records the TCP segments that cross one interface of a
// namespace (an Ethernet or an L3 device), over IPv4 and IPv6, in both
// directions.
type Capture struct {
	f      *os.File
	done   chan struct{}
	closed atomic.Bool

	mu       sync.Mutex
	segments []Segment
	dropped  int
	err      error
	// markers are byte strings the test looks for in payloads.
	markers [][]byte
}

// Watch makes the capture look for marker in every TCP payload from now on
// (Segment.Marked, Seen): a test proves that a payload crossed the wire in
// clear, or never did. Choose markers much shorter than a segment and
// repeat them in the payload, so that a segment boundary cannot hide every
// copy.
func (c *Capture) Watch(marker []byte) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.markers = append(c.markers, bytes.Clone(marker))
}

// Seen returns the segments whose payload held marker.
func (c *Capture) Seen(marker []byte) []Segment {
	var out []Segment
	for _, s := range c.Segments() {
		if s.Marked && s.marker != nil && bytes.Equal(s.marker, marker) {
			out = append(out, s)
		}
	}
	return out
}

// Capture starts recording TCP on the interface ifname of the namespace,
// from an AF_PACKET socket opened inside it. It stops at Close, or when the
// test ends.
func (ns *NS) Capture(t testing.TB, ifname string) *Capture {
	t.Helper()
	f, err := ns.PacketSocket(ifname)
	must(t, err)
	c := &Capture{f: f, done: make(chan struct{})}
	go c.read()
	t.Cleanup(c.Close)
	return c
}

// PacketSocket opens an AF_PACKET socket inside the namespace that receives
// every frame of the interface ifname, both directions, from its link
// header on (none on an L3 device). It is non-blocking: in an os.File it
// goes through the runtime's poller, so that Close wakes a reader at once.
func (ns *NS) PacketSocket(ifname string) (*os.File, error) {
	var fd int
	err := ns.Do(func() error {
		l, err := netlink.LinkByName(ifname)
		if err != nil {
			return err
		}
		// Protocol 0 receives nothing until bind names the protocol and the
		// interface: frames of other interfaces never reach us.
		fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, 0)
		if err != nil {
			return wrap(err, "packet socket")
		}
		sa := &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: l.Attrs().Index}
		if err := unix.Bind(fd, sa); err != nil {
			unix.Close(fd)
			return wrap(err, "bind packet socket to %s", ifname)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return os.NewFile(uintptr(fd), "packets:"+ifname), nil
}

func (c *Capture) read() {
	defer close(c.done)
	rc, err := c.f.SyscallConn()
	if err != nil {
		c.fail(err)
		return
	}
	var (
		eth   layers.Ethernet
		ip4   layers.IPv4
		ip6   layers.IPv6
		tcp   layers.TCP
		found []gopacket.LayerType
		buf   = make([]byte, captureBuf)
		// Frames of an Ethernet device, and packets of an L3 device
		// (no link header: a tun, WireGuard's), by their IP version.
		ethernet = gopacket.NewDecodingLayerParser(layers.LayerTypeEthernet, &eth, &ip4, &ip6, &tcp)
		fromIPv4 = gopacket.NewDecodingLayerParser(layers.LayerTypeIPv4, &ip4, &tcp)
		fromIPv6 = gopacket.NewDecodingLayerParser(layers.LayerTypeIPv6, &ip6, &tcp)
	)
	for _, p := range []*gopacket.DecodingLayerParser{ethernet, fromIPv4, fromIPv6} {
		p.IgnoreUnsupported = true // ARP, ICMP, UDP, payload: not ours
	}
	for {
		var (
			n    int
			from unix.Sockaddr
			rerr error
		)
		err := rc.Read(func(fd uintptr) bool {
			n, from, rerr = unix.Recvfrom(int(fd), buf, 0)
			return rerr != unix.EAGAIN
		})
		if err != nil {
			if !c.closed.Load() {
				c.fail(err)
			}
			return
		}
		switch rerr {
		case nil:
		case unix.ENETDOWN, unix.EINTR:
			// The interface went down (and may come up again): the
			// socket reports it once and then waits for frames.
			continue
		default:
			c.fail(rerr)
			return
		}
		at := time.Now()
		parser := ethernet
		if ll, ok := from.(*unix.SockaddrLinklayer); ok && ll.Hatype == unix.ARPHRD_NONE && n > 0 {
			parser = fromIPv4
			if buf[0]>>4 == 6 {
				parser = fromIPv6
			}
		}
		if err := parser.DecodeLayers(buf[:n], &found); err != nil || len(found) < 2 || found[len(found)-1] != layers.LayerTypeTCP {
			continue
		}
		s := Segment{
			Time: at,
			SYN:  tcp.SYN, FIN: tcp.FIN, RST: tcp.RST, ACK: tcp.ACK,
			Payload: len(tcp.Payload),
			Head:    bytes.Clone(tcp.Payload[:min(len(tcp.Payload), HeadSize)]),
		}
		if m := c.marker(tcp.Payload); m != nil {
			s.Marked, s.marker = true, m
		}
		if ll, ok := from.(*unix.SockaddrLinklayer); ok {
			s.Outgoing = ll.Pkttype == unix.PACKET_OUTGOING
		}
		src, dst := ip6.SrcIP, ip6.DstIP
		if found[len(found)-2] == layers.LayerTypeIPv4 {
			src, dst = ip4.SrcIP, ip4.DstIP
		}
		srcAddr, _ := netip.AddrFromSlice(src)
		dstAddr, _ := netip.AddrFromSlice(dst)
		s.Src = netip.AddrPortFrom(srcAddr.Unmap(), uint16(tcp.SrcPort))
		s.Dst = netip.AddrPortFrom(dstAddr.Unmap(), uint16(tcp.DstPort))
		c.add(s)
	}
}

// marker returns the first watched marker the payload holds, or nil.
func (c *Capture) marker(payload []byte) []byte {
	if len(payload) == 0 {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, m := range c.markers {
		if bytes.Contains(payload, m) {
			return m
		}
	}
	return nil
}

func (c *Capture) add(s Segment) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.segments) >= MaxSegments {
		c.dropped++
		return
	}
	c.segments = append(c.segments, s)
}

func (c *Capture) fail(err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.err = err
}

// Segments returns a copy of the segments recorded so far, in the order
// they were read.
func (c *Capture) Segments() []Segment {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]Segment(nil), c.segments...)
}

// Dropped is the number of segments seen but not kept, beyond MaxSegments.
func (c *Capture) Dropped() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.dropped
}

// Err is what stopped the capture before Close, if anything did.
func (c *Capture) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

// Close stops the capture and waits for its reader; the segments stay
// readable. Closing again does nothing.
func (c *Capture) Close() {
	c.closed.Store(true)
	c.f.Close() // later calls return os.ErrClosed, which is fine
	<-c.done
}

// htons puts a protocol number in network byte order, as packet sockets
// want it.
func htons(v uint16) uint16 {
	var b [2]byte
	binary.BigEndian.PutUint16(b[:], v)
	return binary.NativeEndian.Uint16(b[:])
}
