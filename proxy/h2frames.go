// SPDX-License-Identifier: Apache-2.0

package proxy

import (
	"encoding/binary"
	"io"

	"golang.org/x/net/http2"
)

// What batchedTLS sees of HTTP/2's frames (RFC 9113, section 4.1) below
// x/net's framer: the writes that are routine WINDOW_UPDATEs alone
// (frameCursor), and the frame size a server announces (frameSizeClamp).
// Frames may be split across writes and reads anywhere.

const frameHeaderLen = 9

// splitHeader gathers a frame header that may come in pieces.
type splitHeader struct {
	b   [frameHeaderLen]byte
	got int
}

// take moves over what p holds of the header and returns the rest of p;
// whole says the header is complete (and the next take starts a new one).
func (h *splitHeader) take(p []byte) (rest []byte, whole bool) {
	n := copy(h.b[h.got:], p)
	h.got += n
	if h.got < frameHeaderLen {
		return p[n:], false
	}
	h.got = 0
	return p[n:], true
}

func (h *splitHeader) length() int                { return int(h.b[0])<<16 | int(h.b[1])<<8 | int(h.b[2]) }
func (h *splitHeader) frameType() http2.FrameType { return http2.FrameType(h.b[3]) }
func (h *splitHeader) flags() http2.Flags         { return http2.Flags(h.b[4]) }

// frameCursor follows the frames HTTP/2 writes.
type frameCursor struct {
	rest   int // bytes of the current frame (or the client's preface) still to come
	header splitHeader
}

// advance moves over p and reports whether p is whole WINDOW_UPDATE frames
// of routine increments (at most maxDeferredIncrement) and nothing else.
func (c *frameCursor) advance(p []byte) (routineUpdatesOnly bool) {
	routineUpdatesOnly = len(p) > 0 && c.rest == 0 && c.header.got == 0
	for len(p) > 0 {
		if c.rest > 0 {
			n := min(c.rest, len(p))
			c.rest -= n
			p = p[n:]
			continue
		}
		var whole bool
		if p, whole = c.header.take(p); !whole {
			return false
		}
		c.rest = c.header.length()
		if c.header.frameType() != http2.FrameWindowUpdate || c.rest != 4 || len(p) < 4 ||
			binary.BigEndian.Uint32(p)&(1<<31-1) > maxDeferredIncrement {
			routineUpdatesOnly = false
		}
	}
	return routineUpdatesOnly && c.rest == 0
}

// frameSizeClamp lowers the largest frame size an HBONE server announces
// (SETTINGS_MAX_FRAME_SIZE) to h2FrameSize in what our HTTP/2 client reads.
// x/net's client keeps a write buffer of the peer's frame size, up to
// 512 KiB, for each open tunnel, idle or not, and has no setting for it
// (golang/go#79831); ztunnel announces 1 MiB. Sending smaller frames than
// the peer allows is always allowed.
//
// A setting split across reads is held back until its end came, so that
// nothing of it reaches the client unchanged.
type frameSizeClamp struct {
	rest     int // bytes of the current frame, other than settings, still to come
	settings int // bytes of the current SETTINGS frame's entries still to come
	header   splitHeader
	setting  [settingLen]byte
	pending  int    // bytes of a split setting gathered in setting
	ready    []byte // the completed setting's bytes not yet returned
}

const settingLen = 6 // a setting's identifier (2 bytes) and value (4)

// read reads from r into p, changing every announced frame size above
// h2FrameSize to h2FrameSize. Like r, it returns no bytes only with an
// error; after an error it may be called again.
func (c *frameSizeClamp) read(r io.Reader, p []byte) (int, error) {
	if len(c.ready) == 0 && c.pending > 0 {
		// Nothing but a split setting's start: gather its end.
		for c.pending < settingLen {
			n, err := r.Read(c.setting[c.pending:])
			c.pending += n
			if err != nil && c.pending < settingLen {
				return 0, err
			}
		}
		clampSetting(c.setting[:])
		c.settings -= settingLen
		c.pending = 0
		c.ready = c.setting[:]
	}
	if len(c.ready) > 0 {
		n := copy(p, c.ready)
		c.ready = c.ready[n:]
		return n, nil
	}
	n, err := r.Read(p)
	if split := c.scan(p[:n]); split > 0 {
		c.pending = copy(c.setting[:], p[n-split:n])
		if n -= split; n == 0 && err == nil {
			return c.read(r, p)
		}
	}
	return n, err
}

// scan moves over b, changing whole frame-size settings. It returns the
// length of a setting's start that b ends with, not moved over.
func (c *frameSizeClamp) scan(b []byte) (split int) {
	for len(b) > 0 {
		switch {
		case c.settings > 0:
			if len(b) < settingLen {
				return len(b)
			}
			clampSetting(b[:settingLen])
			c.settings -= settingLen
			b = b[settingLen:]
		case c.rest > 0:
			k := min(c.rest, len(b))
			c.rest -= k
			b = b[k:]
		default:
			var whole bool
			if b, whole = c.header.take(b); !whole {
				continue
			}
			// A SETTINGS frame that is not whole settings is one the
			// client rejects: it is left as it is.
			if length := c.header.length(); c.header.frameType() == http2.FrameSettings &&
				c.header.flags()&http2.FlagSettingsAck == 0 && length%settingLen == 0 {
				c.settings = length
			} else {
				c.rest = c.header.length()
			}
		}
	}
	return 0
}

// clampSetting lowers a frame-size setting above h2FrameSize to it. A value
// beyond HTTP/2's largest frame is left for the client to reject.
func clampSetting(s []byte) {
	if http2.SettingID(binary.BigEndian.Uint16(s)) != http2.SettingMaxFrameSize {
		return
	}
	if v := binary.BigEndian.Uint32(s[2:]); v > h2FrameSize && v <= maxFrameSize {
		binary.BigEndian.PutUint32(s[2:], h2FrameSize)
	}
}

// maxFrameSize is the largest frame size HTTP/2 allows to announce.
const maxFrameSize = 1<<24 - 1
