// SPDX-License-Identifier: Apache-2.0

package inpod

import (
	"encoding/binary"
	"errors"
	"fmt"
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
		req := nl.NewNetlinkRequest(nl.SOCK_DIAG_BY_FAMILY, unix.NLM_F_DUMP)
		req.Sockets = map[int]*nl.SocketHandle{unix.NETLINK_INET_DIAG: {Socket: sock}}
		req.AddData(listenersRequest{family: family})
		err := req.ExecuteIter(unix.NETLINK_INET_DIAG, nl.SOCK_DIAG_BY_FAMILY, func(msg []byte) bool {
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

// listenersRequest is an inet_diag_req_v2 for the TCP sockets of a family
// in state LISTEN.
type listenersRequest struct{ family uint8 }

// inetDiagReqV2Len is the size of struct inet_diag_req_v2: family,
// protocol, extensions, a pad byte, the states, and a 48-byte socket id
// (unused in a dump).
const inetDiagReqV2Len = 56

func (r listenersRequest) Len() int { return inetDiagReqV2Len }

func (r listenersRequest) Serialize() []byte {
	b := make([]byte, inetDiagReqV2Len)
	b[0], b[1] = r.family, unix.IPPROTO_TCP
	binary.NativeEndian.PutUint32(b[4:8], 1<<tcpListen)
	return b
}

// tcpListen is TCP_LISTEN of the kernel's TCP states.
const tcpListen = 10

// closeConnections aborts the namespace's TCP sockets of conns
// (SOCK_DESTROY: the socket fails with ECONNABORTED, its peer gets a
// reset) and returns how many there were. Each is looked up first and
// destroyed by its cookie: the kernel's lookup of a connection that is
// gone finds the listener of its port, which must live on. The kernel
// needs CONFIG_INET_DIAG_DESTROY.
func closeConnections(h netns.NsHandle, conns []steering.Conn) (int, error) {
	sock, err := nl.GetNetlinkSocketAt(h, netns.None(), unix.NETLINK_INET_DIAG)
	if err != nil {
		return 0, err
	}
	defer sock.Close()
	// The lookup's answer is the socket or an error, the destruction's an
	// acknowledgement: asked for on the lookup, it would be left unread.
	execute := func(msgType, flags int, r sockRequest) ([][]byte, error) {
		req := nl.NewNetlinkRequest(msgType, flags)
		req.Sockets = map[int]*nl.SocketHandle{unix.NETLINK_INET_DIAG: {Socket: sock}}
		req.AddData(r)
		return req.Execute(unix.NETLINK_INET_DIAG, nl.SOCK_DIAG_BY_FAMILY)
	}
	closed := 0
	for _, c := range conns {
		msgs, err := execute(nl.SOCK_DIAG_BY_FAMILY, 0, sockRequest{conn: c, cookie: noCookie})
		switch {
		case errors.Is(err, unix.ENOENT):
			continue // closed already
		case err != nil:
			return closed, fmt.Errorf("look up %s -> %s: %w", c.Local, c.Remote, err)
		case len(msgs) != 1 || len(msgs[0]) < inetDiagMsgCookieEnd:
			return closed, fmt.Errorf("look up %s -> %s: %d answers", c.Local, c.Remote, len(msgs))
		case msgs[0][1] == tcpListen:
			continue // the connection is gone, its port's listener found
		}
		cookie := [8]byte(msgs[0][inetDiagMsgCookieEnd-8 : inetDiagMsgCookieEnd])
		_, err = execute(nl.SOCK_DESTROY, unix.NLM_F_ACK, sockRequest{conn: c, cookie: cookie})
		switch {
		case err == nil:
			closed++
		case errors.Is(err, unix.ENOENT):
			// Closed in between.
		default:
			return closed, fmt.Errorf("close %s -> %s: %w", c.Local, c.Remote, err)
		}
	}
	return closed, nil
}

// inetDiagMsgCookieEnd: struct inet_diag_msg is family, state, timer,
// retrans, then the socket id, whose cookie ends it at byte 52.
const inetDiagMsgCookieEnd = 52

// noCookie is INET_DIAG_NOCOOKIE twice: any socket of those ends.
var noCookie = [8]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}

// sockRequest is an inet_diag_req_v2 naming one TCP socket by its ends
// and cookie, in any state. An IPv4 connection is looked up among IPv4
// ends, which covers an IPv6 socket's IPv4-mapped ones too.
type sockRequest struct {
	conn   steering.Conn
	cookie [8]byte
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
	// interface (any), the cookie as the kernel gave it.
	binary.BigEndian.PutUint16(b[8:10], r.conn.Local.Port())
	binary.BigEndian.PutUint16(b[10:12], r.conn.Remote.Port())
	copy(b[12:28], local.AsSlice())
	copy(b[28:44], remote.AsSlice())
	copy(b[48:56], r.cookie[:])
	return b
}
