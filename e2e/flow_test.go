// SPDX-License-Identifier: Apache-2.0

package e2e_test

import (
	"bufio"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/mtlsbridge/mtlsbridge/internal/netnstest"
	"github.com/mtlsbridge/mtlsbridge/proxy"
)

// flowPayload is the size of each flow's request: several segments.
const flowPayload = 48 << 10

// captureLag is how long the underlay capture may lag behind a finished
// request (its reader is a goroutine on a packet socket).
const captureLag = 300 * time.Millisecond

// flow is one request from a pod to another's digest server, and what the
// proxies and the underlay saw of it.
type flow struct {
	from, to *bedPod
	dst      netip.AddrPort
	reply    reply
	err      error
	// out and in are the proxies' "Connection opened" records of the
	// flow: the source node's outbound one, the destination node's
	// inbound one (nil when the flow did not cross that proxy).
	out, in logRecord
	// visible: the request's marker crossed the underlay in clear.
	visible bool
	// segments are the underlay's segments between the two pods'
	// addresses while the flow ran.
	segments []netnstest.Segment
}

// plainSegments are the flow's underlay segments outside HBONE (neither
// end on port 15008): when the source's proxy is gone, the HBONE
// connections it held close, but nothing else may leave.
func (f *flow) plainSegments() []netnstest.Segment {
	var out []netnstest.Segment
	for _, s := range f.segments {
		if s.Src.Port() != proxy.HBONEPort && s.Dst.Port() != proxy.HBONEPort {
			out = append(out, s)
		}
	}
	return out
}

// enrolledLabel says which ends are enrolled.
func (f *flow) enrolledLabel() string {
	e := func(p *bedPod) string {
		if p.enrolled {
			return "yes"
		}
		return "no"
	}
	return e(f.from) + "->" + e(f.to)
}

// path is how the flow went, from the proxies' records.
func (f *flow) path() string {
	switch {
	case f.err != nil:
		msg := f.err.Error()
		if len(msg) > 80 {
			msg = "..." + msg[len(msg)-77:]
		}
		return "failed: " + msg
	case f.out != nil && f.out["protocol"] == proxy.ProtocolHBONE:
		return "mTLS (HBONE) " + f.out["sourceIdentity"] + " -> " + f.out["destinationIdentity"]
	case f.out != nil:
		return "plain, through the proxy (pod's own source address)"
	case f.in != nil:
		return "plain, into the destination's proxy (client's own source address)"
	}
	return "plain, direct (not proxied)"
}

func (f *flow) String() string {
	return fmt.Sprintf("%-7s -> %-7s %-26s enrolled %-7s %-90s payload on the underlay: %v",
		f.from, f.to, f.dst, f.enrolledLabel(), f.path(), f.visible)
}

// run sends one flow from a pod to another's digest server over IPv4 or
// IPv6 and gathers what the proxies and the underlay saw.
func (b *bed) run(from, to *bedPod, v6 bool) *flow {
	return b.runTo(from, to, netip.AddrPortFrom(to.addr(v6), digestPort))
}

func (b *bed) runTo(from, to *bedPod, dst netip.AddrPort) *flow {
	f := &flow{from: from, to: to, dst: dst}
	marker := newMarker(from.name + "-" + to.name)
	b.underlay.Watch(marker)
	first := len(b.underlay.Segments())
	offsets := b.logOffsets()
	f.reply, f.err = send(from, dst, requestBody(marker, flowPayload))
	time.Sleep(captureLag)
	f.visible = len(b.underlay.Seen(marker)) > 0
	for _, s := range b.underlay.Segments()[first:] {
		ends := []netip.Addr{s.Src.Addr(), s.Dst.Addr()}
		if (ends[0] == from.addr(dst.Addr().Is6()) && ends[1] == dst.Addr()) || (ends[1] == from.addr(dst.Addr().Is6()) && ends[0] == dst.Addr()) {
			f.segments = append(f.segments, s)
		}
	}
	src := from.addr(dst.Addr().Is6())
	match := func(direction string) func(logRecord) bool {
		return func(r logRecord) bool {
			s, err1 := netip.ParseAddrPort(r["source"])
			d, err2 := netip.ParseAddrPort(r["destination"])
			return r["msg"] == "Connection opened" && r["direction"] == direction && err1 == nil && err2 == nil &&
				s.Addr() == src && d == dst
		}
	}
	f.out = b.findLog(from.node, offsets[from.node.index-1], match(proxy.DirectionOutbound))
	f.in = b.findLog(to.node, offsets[to.node.index-1], match(proxy.DirectionInbound))
	return f
}

func newMarker(prefix string) []byte {
	r := make([]byte, 6)
	rand.Read(r)
	return []byte("MARK-" + prefix + "-" + hex.EncodeToString(r))
}

// logRecord is one line of a proxy's log (slog text format).
type logRecord map[string]string

func (b *bed) logOffsets() [2]int64 {
	var o [2]int64
	for i, n := range b.nodes {
		if st, err := os.Stat(filepath.Join(n.stateDir, "proxy.log")); err == nil {
			o[i] = st.Size()
		}
	}
	return o
}

// findLog returns the first record of the node's proxy log after offset
// that matches.
func (b *bed) findLog(n *bedNode, offset int64, match func(logRecord) bool) logRecord {
	f, err := os.Open(filepath.Join(n.stateDir, "proxy.log"))
	if err != nil {
		return nil
	}
	defer f.Close()
	f.Seek(offset, 0)
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		if r := parseLogLine(sc.Text()); match(r) {
			return r
		}
	}
	return nil
}

// parseLogLine reads key=value pairs, values optionally quoted.
func parseLogLine(line string) logRecord {
	r := logRecord{}
	for line != "" {
		line = strings.TrimLeft(line, " ")
		k, rest, ok := strings.Cut(line, "=")
		if !ok {
			break
		}
		var v string
		if strings.HasPrefix(rest, `"`) {
			end := 1
			for end < len(rest) && (rest[end] != '"' || rest[end-1] == '\\') {
				end++
			}
			v = strings.ReplaceAll(rest[1:min(end, len(rest))], `\"`, `"`)
			rest = rest[min(end+1, len(rest)):]
		} else {
			v, rest, _ = strings.Cut(rest, " ")
		}
		r[k] = v
		line = rest
	}
	return r
}
