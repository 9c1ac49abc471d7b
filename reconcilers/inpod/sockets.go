// SPDX-License-Identifier: Apache-2.0

package inpod

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"slices"

	"github.com/vishvananda/netlink/nl"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/mtlsbridge/mtlsbridge/reconcilers/steering"
)

// The pod's TCP sockets, through sock_diag in its namespace: the listener
// check and the closing of connections another mode's agent held.

// listeningPorts reports which of ports a TCP socket of the namespace
// listens on. The kernel is asked for listening sockets only, and each
// is looked at as it comes: the pod decides how many sockets it holds (a
// million connections in TIME_WAIT need no descriptor), and a listing of
// them all (netlink's SocketDiagTCP) cost the agent about 350 bytes each.
func listeningPorts(h netns.NsHandle, ports []uint16) (map[uint16]bool, error) {
	// The diag socket must be opened in the namespace.
	sock, err := nl.GetNetlinkSocketAt(h, netns.None(), unix.NETLINK_INET_DIAG)
	if err != nil {
		return nil, err
	}
	defer sock.Close()
	listening := map[uint16]bool{}
	for _, family := range []uint8{unix.AF_INET, unix.AF_INET6} {
		err := dumpTCP(sock, family, 1<<tcpListen, func(msg []byte) bool {
			// struct inet_diag_msg: family, state, timer, retrans, then
			// the socket id, its source port first (network order).
			if len(msg) >= 6 && msg[1] == tcpListen {
				if port := binary.BigEndian.Uint16(msg[4:6]); slices.Contains(ports, port) {
					listening[port] = true
				}
			}
			return true
		})
		switch {
		case errors.Is(err, nl.ErrDumpInterrupted):
			// A listing that changed while dumped may miss a listener:
			// not a gap to report.
			return nil, fmt.Errorf("listening sockets: %w", err)
		case err != nil && family == unix.AF_INET6:
			// IPv6 disabled.
		case err != nil:
			return nil, err
		}
	}
	return listening, nil
}

// dumpTCP streams the TCP sockets of a family in states (a bit per state)
// to fn, each as a struct inet_diag_msg, through sock (opened in the
// namespace: sock_diag answers for the socket's own), until fn says stop.
func dumpTCP(sock *nl.NetlinkSocket, family uint8, states uint32, fn func(msg []byte) bool) error {
	req := nl.NewNetlinkRequest(nl.SOCK_DIAG_BY_FAMILY, unix.NLM_F_DUMP)
	req.Sockets = map[int]*nl.SocketHandle{unix.NETLINK_INET_DIAG: {Socket: sock}}
	req.AddData(statesRequest{family: family, states: states})
	return req.ExecuteIter(unix.NETLINK_INET_DIAG, nl.SOCK_DIAG_BY_FAMILY, fn)
}

// statesRequest is an inet_diag_req_v2 for the TCP sockets of a family
// in the given states (a bit per state).
type statesRequest struct {
	family uint8
	states uint32
}

// inetDiagReqV2Len is the size of struct inet_diag_req_v2: family,
// protocol, extensions, a pad byte, the states, and a 48-byte socket id
// (unused in a dump).
const inetDiagReqV2Len = 56

func (r statesRequest) Len() int { return inetDiagReqV2Len }

func (r statesRequest) Serialize() []byte {
	b := make([]byte, inetDiagReqV2Len)
	b[0], b[1] = r.family, unix.IPPROTO_TCP
	binary.NativeEndian.PutUint32(b[4:8], r.states)
	return b
}

// tcpListen is TCP_LISTEN of the kernel's TCP states.
const tcpListen = 10

// closeConnections aborts the namespace's TCP connections with the ends of
// conns and returns how many there were.
func closeConnections(h netns.NsHandle, conns []steering.Conn) (int, error) {
	return closeMatching(h, func(c steering.Conn) bool { return slices.Contains(conns, c) })
}

// closeAll aborts every TCP connection of the namespace and returns how
// many there were.
func closeAll(h netns.NsHandle) (int, error) {
	return closeMatching(h, func(steering.Conn) bool { return true })
}

// closeMatching aborts the namespace's TCP connections (SOCK_DESTROY: the
// socket fails with ECONNABORTED, its peer gets a reset) whose ends match,
// each as a dump shows it: by its cookie and interface (a socket bound to
// one is found only so), never a listener. The dump is read as it comes
// (the pod decides how many sockets it holds) and run again while it
// finds some: the kernel resumes a dump by position, which sockets closed
// under it shift.
//
// Possible errors: one wrapping steering.ErrCannotClose.
func closeMatching(h netns.NsHandle, match func(steering.Conn) bool) (int, error) {
	dump, err := nl.GetNetlinkSocketAt(h, netns.None(), unix.NETLINK_INET_DIAG)
	if err != nil {
		return 0, err
	}
	defer dump.Close()
	destroy, err := nl.GetNetlinkSocketAt(h, netns.None(), unix.NETLINK_INET_DIAG)
	if err != nil {
		return 0, err
	}
	defer destroy.Close()
	closed, found := 0, 0
	var errs []error
	closeOne := func(msg []byte) bool {
		r, ok := parseDiagMsg(msg)
		if !ok || !match(r.conn) {
			return true
		}
		found++
		req := nl.NewNetlinkRequest(nl.SOCK_DESTROY, unix.NLM_F_ACK)
		req.Sockets = map[int]*nl.SocketHandle{unix.NETLINK_INET_DIAG: {Socket: destroy}}
		req.AddData(r)
		switch _, err := req.Execute(unix.NETLINK_INET_DIAG, 0); {
		case err == nil:
			closed++
		case errors.Is(err, unix.ENOENT):
			// Closed in between (its peer's reset, on loopback).
		case errors.Is(err, unix.EOPNOTSUPP):
			errs = append(errs, steering.ErrCannotClose)
			return false
		default:
			errs = append(errs, fmt.Errorf("close %s -> %s: %w", r.conn.Local, r.conn.Remote, err))
		}
		return len(errs) < 10 // the same error for every socket says it all
	}
	for pass := 0; pass < 4 && (pass == 0 || found > 0) && len(errs) == 0; pass++ {
		found = 0
		for _, family := range []uint8{unix.AF_INET, unix.AF_INET6} {
			err := dumpTCP(dump, family, connectionStates, closeOne)
			switch {
			case err != nil && family == unix.AF_INET6 && !errors.Is(err, nl.ErrDumpInterrupted):
				// IPv6 disabled.
			case err != nil:
				errs = append(errs, fmt.Errorf("list the connections: %w", err))
			}
			if len(errs) > 0 {
				break
			}
		}
	}
	return closed, errors.Join(errs...)
}

// connectionStates are the TCP states of a connection that can still
// carry data either way (not listening, closed or in TIME_WAIT).
const connectionStates = 1<<1 | 1<<2 | 1<<3 | 1<<4 | 1<<5 | 1<<8 | 1<<9 | 1<<11

// inetDiagMsgCookieEnd: struct inet_diag_msg is family, state, timer,
// retrans, then the socket id, whose cookie ends it at byte 52.
const inetDiagMsgCookieEnd = 52

// sockRequest is an inet_diag_req_v2 naming one TCP socket by its ends,
// interface and cookie, in any state. An IPv4 connection is named by
// IPv4 ends, which covers an IPv6 socket's IPv4-mapped ones too.
type sockRequest struct {
	conn    steering.Conn
	ifindex uint32
	cookie  [8]byte
}

func (r sockRequest) Len() int { return inetDiagReqV2Len }

func (r sockRequest) Serialize() []byte {
	b := make([]byte, inetDiagReqV2Len)
	local, remote := r.conn.Local.Addr().Unmap(), r.conn.Remote.Addr().Unmap()
	b[0], b[1] = unix.AF_INET6, unix.IPPROTO_TCP
	if local.Is4() {
		b[0] = unix.AF_INET
	}
	binary.NativeEndian.PutUint32(b[4:8], ^uint32(0)) // any state
	// struct inet_diag_sockid: ports and addresses in network order, the
	// interface and the cookie as the kernel gave them.
	binary.BigEndian.PutUint16(b[8:10], r.conn.Local.Port())
	binary.BigEndian.PutUint16(b[10:12], r.conn.Remote.Port())
	copy(b[12:28], local.AsSlice())
	copy(b[28:44], remote.AsSlice())
	binary.NativeEndian.PutUint32(b[44:48], r.ifindex)
	copy(b[48:56], r.cookie[:])
	return b
}

// parseDiagMsg reads the socket of a struct inet_diag_msg: family, state,
// timer, retrans, then the socket id (ports and addresses in network
// order, the interface, the cookie).
func parseDiagMsg(msg []byte) (sockRequest, bool) {
	if len(msg) < inetDiagMsgCookieEnd {
		return sockRequest{}, false
	}
	addr := func(b []byte) netip.Addr {
		if msg[0] == unix.AF_INET {
			return netip.AddrFrom4([4]byte(b[:4]))
		}
		return netip.AddrFrom16([16]byte(b[:16]))
	}
	return sockRequest{
		conn: steering.Conn{
			Local:  netip.AddrPortFrom(addr(msg[8:24]).Unmap(), binary.BigEndian.Uint16(msg[4:6])),
			Remote: netip.AddrPortFrom(addr(msg[24:40]).Unmap(), binary.BigEndian.Uint16(msg[6:8])),
		},
		ifindex: binary.NativeEndian.Uint32(msg[40:44]),
		cookie:  [8]byte(msg[inetDiagMsgCookieEnd-8 : inetDiagMsgCookieEnd]),
	}, true
}
