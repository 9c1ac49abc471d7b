// SPDX-License-Identifier: Apache-2.0

package zds

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"
	"istio.io/istio/pkg/zdsapi"
)

// MaxMessage is the largest datagram either side reads: ztunnel's receive
// buffer. A longer one arrives truncated, which is an error.
const MaxMessage = 1024

// maxRights is how many descriptors a read makes room for, so that too
// many are seen and refused rather than silently cut (MSG_CTRUNC).
const maxRights = 8

// Conn is one ZDS connection (either end) on a SOCK_SEQPACKET socket.
// Methods are not safe for concurrent use; the protocol is lock-step.
type Conn struct {
	c *net.UnixConn
}

// NewConn wraps an accepted or dialed "unixpacket" connection.
func NewConn(c *net.UnixConn) *Conn { return &Conn{c: c} }

// Dial connects to a node agent's socket (ztunnel's side).
func Dial(path string) (*Conn, error) {
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		return nil, err
	}
	return NewConn(c), nil
}

// Close closes the connection.
func (c *Conn) Close() error { return c.c.Close() }

// SetDeadline bounds the next reads and writes; zero removes the bound.
func (c *Conn) SetDeadline(t time.Time) error { return c.c.SetDeadline(t) }

// write sends one message with at most one descriptor.
func (c *Conn) write(m proto.Message, fd *os.File) error {
	b, err := proto.Marshal(m)
	if err != nil {
		return err
	}
	if len(b) > MaxMessage {
		return fmt.Errorf("%w: %d bytes, the peer reads at most %d", ErrMessage, len(b), MaxMessage)
	}
	var oob []byte
	if fd != nil {
		oob = unix.UnixRights(int(fd.Fd()))
	}
	n, oobn, err := c.c.WriteMsgUnix(b, oob, nil)
	if err == nil && (n != len(b) || oobn != len(oob)) {
		err = fmt.Errorf("short write: %d of %d bytes, %d of %d control bytes", n, len(b), oobn, len(oob))
	}
	return err
}

// read receives one datagram into m and returns the descriptors that came
// with it. Possible errors: io.EOF when the peer closed, ErrMessage,
// ErrTimeout when the deadline passed.
func (c *Conn) read(m proto.Message) ([]*os.File, error) {
	buf := make([]byte, MaxMessage)
	oob := make([]byte, unix.CmsgSpace(maxRights*4))
	n, oobn, flags, _, err := c.c.ReadMsgUnix(buf, oob)
	fds, rerr := rights(oob[:oobn])
	fail := func(err error) ([]*os.File, error) {
		for _, f := range fds {
			f.Close()
		}
		return nil, err
	}
	switch {
	case errors.Is(err, os.ErrDeadlineExceeded):
		return fail(ErrTimeout)
	case err != nil:
		return fail(err)
	case n == 0 && oobn == 0:
		return fail(io.EOF) // a SOCK_SEQPACKET peer that closed reads as empty
	case rerr != nil:
		return fail(fmt.Errorf("%w: control message: %v", ErrMessage, rerr))
	case flags&unix.MSG_TRUNC != 0:
		return fail(fmt.Errorf("%w: truncated (more than %d bytes)", ErrMessage, MaxMessage))
	case flags&unix.MSG_CTRUNC != 0:
		return fail(fmt.Errorf("%w: control message truncated (more than %d descriptors)", ErrMessage, maxRights))
	}
	if err := proto.Unmarshal(buf[:n], m); err != nil {
		return fail(fmt.Errorf("%w: %v", ErrMessage, err))
	}
	return fds, nil
}

// rights returns the descriptors of SCM_RIGHTS control messages.
func rights(oob []byte) ([]*os.File, error) {
	if len(oob) == 0 {
		return nil, nil
	}
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, err
	}
	var files []*os.File
	var errs []error
	for _, m := range msgs {
		fds, err := unix.ParseUnixRights(&m)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		for _, fd := range fds {
			files = append(files, os.NewFile(uintptr(fd), "zds-fd"))
		}
	}
	return files, errors.Join(errs...)
}

// ReadHello reads ztunnel's first message (server side).
func (c *Conn) ReadHello() (*zdsapi.ZdsHello, error) {
	h := &zdsapi.ZdsHello{}
	fds, err := c.read(h)
	if err != nil {
		return nil, err
	}
	if len(fds) > 0 {
		closeAll(fds)
		return nil, fmt.Errorf("%w: a hello with descriptors", ErrMessage)
	}
	if h.GetVersion() != zdsapi.Version_V1 {
		return nil, fmt.Errorf("%w: hello of version %v, want %v", ErrProtocol, h.GetVersion(), zdsapi.Version_V1)
	}
	return h, nil
}

// Request sends one request, with netns for an add, and waits for its
// Ack until the deadline (server side). A nack comes back as an error
// that is neither ErrTimeout nor io.EOF: the connection goes on.
//
// Possible errors: ErrTimeout, io.EOF, ErrMessage, *NackError.
func (c *Conn) Request(req *zdsapi.WorkloadRequest, netns *os.File, deadline time.Time) error {
	if err := c.c.SetDeadline(deadline); err != nil {
		return err
	}
	if err := c.write(req, netns); err != nil {
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return ErrTimeout
		}
		return err
	}
	resp := &zdsapi.WorkloadResponse{}
	fds, err := c.read(resp)
	if err != nil {
		return err
	}
	if len(fds) > 0 {
		closeAll(fds)
		return fmt.Errorf("%w: a response with descriptors", ErrMessage)
	}
	ack := resp.GetAck()
	if ack == nil {
		return fmt.Errorf("%w: a response without ack", ErrMessage)
	}
	if ack.GetError() != "" {
		return &NackError{Reason: ack.GetError()}
	}
	return nil
}

// NackError is ztunnel's refusal of a request.
type NackError struct{ Reason string }

func (e *NackError) Error() string { return "ztunnel refused: " + e.Reason }

// SendHello announces the client (ztunnel's side).
func (c *Conn) SendHello() error {
	return c.write(&zdsapi.ZdsHello{Version: zdsapi.Version_V1}, nil)
}

// ReadRequest reads the node agent's next request and its descriptors
// (ztunnel's side). The caller owns the files.
func (c *Conn) ReadRequest() (*zdsapi.WorkloadRequest, []*os.File, error) {
	req := &zdsapi.WorkloadRequest{}
	fds, err := c.read(req)
	return req, fds, err
}

// SendAck answers the last request: nil acknowledges, an error refuses
// with its text (ztunnel's side).
func (c *Conn) SendAck(err error) error {
	ack := &zdsapi.Ack{}
	if err != nil {
		ack.Error = err.Error()
		if ack.Error == "" {
			ack.Error = "error"
		}
	}
	return c.write(&zdsapi.WorkloadResponse{Payload: &zdsapi.WorkloadResponse_Ack{Ack: ack}}, nil)
}

func closeAll(fds []*os.File) {
	for _, f := range fds {
		f.Close()
	}
}

// CheckNetns tells whether f is a network namespace, as ztunnel checks
// the descriptor of an add (ioctl NS_GET_NSTYPE).
//
// Possible errors: ErrNotNetns.
func CheckNetns(f *os.File) error {
	const nsGetNSType = 0xb703 // _IO(0xb7, 0x3), linux/nsfs.h
	t, err := unix.IoctlRetInt(int(f.Fd()), nsGetNSType)
	if err != nil {
		return fmt.Errorf("%w: %s: %v", ErrNotNetns, f.Name(), err)
	}
	if t != unix.CLONE_NEWNET {
		return fmt.Errorf("%w: %s: namespace type %#x", ErrNotNetns, f.Name(), t)
	}
	return nil
}

// CheckAlive tells whether the peer is still there without waiting for
// it (server side, between requests): ztunnel sends nothing unasked, so a
// read must time out. Possible errors: io.EOF when the peer closed,
// ErrProtocol when it sent something unasked.
func (c *Conn) CheckAlive() error {
	if err := c.c.SetReadDeadline(time.Now().Add(10 * time.Millisecond)); err != nil {
		return err
	}
	resp := &zdsapi.WorkloadResponse{}
	fds, err := c.read(resp)
	closeAll(fds)
	switch {
	case errors.Is(err, ErrTimeout):
		return nil
	case err != nil:
		return err
	}
	return fmt.Errorf("%w: a message nothing asked for", ErrProtocol)
}
