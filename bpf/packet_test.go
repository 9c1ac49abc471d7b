// SPDX-License-Identifier: Apache-2.0

package bpf_test

import (
	"encoding/binary"
	"net"
	"net/netip"
)

// Crafted frames for BPF_PROG_TEST_RUN. Checksums are left zero: the
// programs never look at them.

const (
	protoTCP  = 6
	protoUDP  = 17
	protoICMP = 1
	protoAH   = 51
)

var (
	podMAC    = net.HardwareAddr{0x02, 0, 0, 0, 0, 0x0a}
	routerMAC = net.HardwareAddr{0x02, 0, 0, 0, 0, 0x01}
)

type packet struct {
	src, dst     netip.Addr
	sport, dport uint16
	proto        uint8
	// extHeaders inserts this many IPv6 option headers before L4 (a
	// hop-by-hop header, then destination options).
	extHeaders int
	// authHeader inserts an authentication header (AH) before L4, in
	// IPv6 after the option headers; not with laterFragment.
	authHeader bool
	// laterFragment makes a fragment with a non-zero offset (no L4
	// header); in IPv6 its fragment header names fragmentNext (default
	// TCP) as the header that follows in the first fragment.
	laterFragment bool
	fragmentNext  uint8
	// tcpFlags default to a SYN.
	tcpFlags uint8
}

const (
	flagSYN = 0x02
	flagACK = 0x10
)

func (p packet) frame() []byte {
	proto := p.proto
	if proto == 0 {
		proto = protoTCP
	}
	l4 := make([]byte, 20)
	binary.BigEndian.PutUint16(l4[0:], p.sport)
	binary.BigEndian.PutUint16(l4[2:], p.dport)
	if proto == protoTCP {
		l4[12] = 5 << 4
		l4[13] = flagSYN
		if p.tcpFlags != 0 {
			l4[13] = p.tcpFlags
		}
	}
	if p.laterFragment {
		l4 = make([]byte, 24) // payload of a later fragment: no ports
	}

	eth := make([]byte, 14)
	copy(eth[0:], routerMAC)
	copy(eth[6:], podMAC)
	// Next header, length 4 (24 bytes: the fixed 12 and a 12-byte ICV).
	ah := make([]byte, 24)
	ah[0], ah[1] = proto, 4
	if p.src.Is4() {
		binary.BigEndian.PutUint16(eth[12:], 0x0800)
		if p.authHeader {
			l4 = append(ah, l4...)
			proto = protoAH
		}
		ip := make([]byte, 20)
		ip[0] = 0x45
		binary.BigEndian.PutUint16(ip[2:], uint16(20+len(l4)))
		if p.laterFragment {
			binary.BigEndian.PutUint16(ip[6:], 185) // offset 1480 bytes
		}
		ip[8] = 64
		ip[9] = proto
		s, d := p.src.As4(), p.dst.As4()
		copy(ip[12:], s[:])
		copy(ip[16:], d[:])
		return append(append(eth, ip...), l4...)
	}
	binary.BigEndian.PutUint16(eth[12:], 0x86dd)
	ip := make([]byte, 40)
	ip[0] = 0x60
	next := proto
	var ext []byte
	for i := p.extHeaders - 1; i >= 0; i-- {
		// 8 bytes: next header, length 0, a PadN option filling the rest.
		ext = append([]byte{next, 0, 1, 4, 0, 0, 0, 0}, ext...)
		next = 60 // destination options
		if i == 0 {
			next = 0 // hop-by-hop, which must come first
		}
	}
	if p.authHeader {
		if len(ext) == 0 {
			next = protoAH
		} else {
			ext[len(ext)-8] = protoAH // the last option header's next
		}
		ext = append(ext, ah...)
	}
	if p.laterFragment {
		fragNext := p.fragmentNext
		if fragNext == 0 {
			fragNext = proto
		}
		// next header, reserved, offset 185 (x 8 bytes) with M=0, id.
		frag := []byte{fragNext, 0, 0, 0, 0, 0, 0, 1}
		binary.BigEndian.PutUint16(frag[2:], 185<<3)
		ext = append(ext, frag...)
		if len(ext) == len(frag) {
			next = 44
		} else {
			ext[len(ext)-len(frag)-8] = 44 // the last option header's next
		}
	}
	binary.BigEndian.PutUint16(ip[4:], uint16(len(ext)+len(l4)))
	ip[6] = next
	ip[7] = 64
	s, d := p.src.As16(), p.dst.As16()
	copy(ip[8:], s[:])
	copy(ip[24:], d[:])
	return append(append(append(eth, ip...), ext...), l4...)
}

// arpFrame is an ARP request: not IP at all.
func arpFrame() []byte {
	f := make([]byte, 42)
	copy(f[0:], net.HardwareAddr{0xff, 0xff, 0xff, 0xff, 0xff, 0xff})
	copy(f[6:], podMAC)
	binary.BigEndian.PutUint16(f[12:], 0x0806)
	return f
}

// skbContext is the head of struct __sk_buff, up to the fields that
// BPF_PROG_TEST_RUN lets a test set; ingress_ifindex is the interface the
// packet came in on.
type skbContext struct {
	Len            uint32
	PktType        uint32
	Mark           uint32
	QueueMapping   uint32
	Protocol       uint32
	VlanPresent    uint32
	VlanTCI        uint32
	VlanProto      uint32
	Priority       uint32
	IngressIfindex uint32
	Ifindex        uint32
}
