// SPDX-License-Identifier: Apache-2.0

package proxy

import (
	"encoding/binary"
	"io"

	"golang.org/x/net/http2"
)

// frameSizeClamp lowers the largest frame size an HBONE server announces
// (SETTINGS_MAX_FRAME_SIZE) to h2FrameSize in what our HTTP/2 client reads.
// x/net's client keeps a write buffer of the peer's frame size, up to
// 512 KiB, for each open tunnel, idle or not, and has no setting for it
// (golang/go#79831): toward ztunnel, which allows 1 MiB frames, an idle
// tunnel held half a megabyte. Sending smaller frames than the peer allows
// is always allowed.
//
// A setting split across reads is completed before anything of it reaches
// the client.
type frameSizeClamp struct {
	rest     int // bytes of the current frame, other than settings, still to come
	settings int // bytes of the current SETTINGS frame's entries still to come
	header   [frameHeaderLen]byte
	got      int // bytes of a split frame header seen
	setting  [settingLen]byte
	ready    []byte // the end of a completed split setting, not yet returned
}

const settingLen = 6 // a setting's identifier (2 bytes) and value (4)

// read reads from r into p, changing every announced frame size above
// h2FrameSize to h2FrameSize.
func (c *frameSizeClamp) read(r io.Reader, p []byte) (int, error) {
	if len(c.ready) > 0 {
		n := copy(p, c.ready)
		c.ready = c.ready[n:]
		return n, nil
	}
	n, err := r.Read(p)
	split := c.scan(p[:n])
	if split == 0 || err != nil {
		return n, err
	}
	// The setting's start came last: read its end, then return it whole.
	s := c.setting[:]
	copy(s, p[n-split:n])
	if _, err := io.ReadFull(r, s[split:]); err != nil {
		return n, err
	}
	clampSetting(s)
	c.settings -= settingLen
	n -= split
	c.ready = s
	if n == 0 {
		n = copy(p, c.ready)
		c.ready = c.ready[n:]
	}
	return n, nil
}

// scan moves over b, changing whole frame-size settings. It returns the
// length of a setting's start that b ends with, not yet moved over.
func (c *frameSizeClamp) scan(b []byte) (split int) {
	for len(b) > 0 {
		switch {
		case c.settings >= settingLen:
			if len(b) < settingLen {
				return len(b)
			}
			clampSetting(b[:settingLen])
			c.settings -= settingLen
			b = b[settingLen:]
		case c.settings > 0: // not a whole setting: the client rejects the frame
			c.rest, c.settings = c.settings, 0
		case c.rest > 0:
			k := min(c.rest, len(b))
			c.rest -= k
			b = b[k:]
		default:
			k := copy(c.header[c.got:], b)
			c.got += k
			b = b[k:]
			if c.got < frameHeaderLen {
				continue
			}
			c.got = 0
			length := int(c.header[0])<<16 | int(c.header[1])<<8 | int(c.header[2])
			if http2.FrameType(c.header[3]) == http2.FrameSettings && http2.Flags(c.header[4])&http2.FlagSettingsAck == 0 {
				c.settings = length
			} else {
				c.rest = length
			}
		}
	}
	return 0
}

// clampSetting lowers a frame-size setting above h2FrameSize to it.
func clampSetting(s []byte) {
	if http2.SettingID(binary.BigEndian.Uint16(s)) == http2.SettingMaxFrameSize &&
		binary.BigEndian.Uint32(s[2:]) > h2FrameSize {
		binary.BigEndian.PutUint32(s[2:], h2FrameSize)
	}
}
