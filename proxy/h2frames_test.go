// SPDX-License-Identifier: Apache-2.0

package proxy

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"runtime"
	"sync"
	"testing"
	"testing/iotest"

	"golang.org/x/net/http2"
)

// TestFrameCursor: the cursor finds the writes that are WINDOW_UPDATE
// frames alone, however HTTP/2's buffered writer cuts frames.
func TestFrameCursor(t *testing.T) {
	update := framed(func(f *http2.Framer) { f.WriteWindowUpdate(0, 4096); f.WriteWindowUpdate(1, 4096) })
	opening := framed(func(f *http2.Framer) { f.WriteWindowUpdate(0, 8<<20-65535) })
	data := framed(func(f *http2.Framer) { f.WriteData(1, false, make([]byte, 3000)) })
	settings := framed(func(f *http2.Framer) { f.WriteSettings() })
	ping := framed(func(f *http2.Framer) { f.WritePing(false, [8]byte{}) })
	preface := []byte(http2.ClientPreface)

	for _, c := range []struct {
		name   string
		client bool
		writes [][]byte
		want   []bool
	}{
		{"updates alone", false, [][]byte{update, update[:13]}, []bool{true, true}},
		{"updates with data", false, [][]byte{append(bytes.Clone(update), data...), data}, []bool{false, false}},
		{"other control frames", false, [][]byte{settings, ping}, []bool{false, false}},
		{"a large update", false, [][]byte{opening, append(bytes.Clone(update), opening...)}, []bool{false, false}},
		{"a frame split across writes", false,
			[][]byte{data[:5], data[5:100], data[100:], update},
			[]bool{false, false, false, true}},
		{"a header split across writes", false,
			[][]byte{update[:4], update[4:]},
			[]bool{false, false}},
		{"updates after a split header", false,
			[][]byte{data[:4], data[4:], update},
			[]bool{false, false, true}},
		{"the client's preface is no frame", true,
			[][]byte{append(bytes.Clone(preface), settings...), update},
			[]bool{false, true}},
		{"the preface read as frames", false,
			[][]byte{preface},
			[]bool{false}},
	} {
		var cursor frameCursor
		if c.client {
			cursor.rest = len(http2.ClientPreface)
		}
		for i, w := range c.writes {
			if got := cursor.advance(w); got != c.want[i] {
				t.Errorf("%s: write %d: %v, want %v", c.name, i, got, c.want[i])
			}
		}
	}
}

// TestFrameSizeClamp: every valid frame size a server announces above
// 16 KiB reads as 16 KiB, and nothing else changes, however the reads cut
// the frames, whatever size the reader asks for, and after an error
// inside a split setting.
func TestFrameSizeClamp(t *testing.T) {
	stream := func(clamped bool) []byte {
		size := func(v uint32) uint32 {
			if clamped && v > h2FrameSize && v <= maxFrameSize {
				return h2FrameSize
			}
			return v
		}
		return framed(func(f *http2.Framer) {
			f.WriteSettings(http2.Setting{ID: http2.SettingHeaderTableSize, Val: 1 << 20},
				http2.Setting{ID: http2.SettingMaxFrameSize, Val: size(1 << 20)})
			// Data that reads like a frame-size setting must stay as it is.
			f.WriteData(1, false, bytes.Repeat([]byte{0, 5, 0, 16, 0, 0}, 20))
			f.WriteSettingsAck()
			f.WriteSettings(http2.Setting{ID: http2.SettingMaxFrameSize, Val: size(h2FrameSize)},
				http2.Setting{ID: http2.SettingMaxFrameSize, Val: size(h2FrameSize + 1)},
				http2.Setting{ID: http2.SettingMaxFrameSize, Val: size(maxFrameSize)},
				// Invalid: the client must see it and reject the frame.
				http2.Setting{ID: http2.SettingMaxFrameSize, Val: size(maxFrameSize + 1)})
			// A SETTINGS frame that is not whole settings, then one that is.
			f.WriteRawFrame(http2.FrameSettings, 0, 0, []byte{0, 5, 0, 16, 0, 0, 7})
			f.WriteSettings(http2.Setting{ID: http2.SettingMaxFrameSize, Val: size(20000)})
			f.WriteWindowUpdate(0, 1<<20)
		})
	}
	announced, want := stream(false), stream(true)

	readAll := func(t *testing.T, r io.Reader, size int) []byte {
		t.Helper()
		var c frameSizeClamp
		var out []byte
		p := make([]byte, size)
		for {
			n, err := c.read(r, p)
			if n > len(p) || n == 0 && err == nil {
				t.Fatalf("read %d into %d bytes, error %v", n, len(p), err)
			}
			out = append(out, p[:n]...)
			if errors.Is(err, io.EOF) {
				return out
			}
			if err != nil && !errors.Is(err, errTryAgain) {
				t.Fatal(err)
			}
		}
	}
	check := func(t *testing.T, what string, got []byte) {
		t.Helper()
		if !bytes.Equal(got, want) {
			t.Fatalf("%s:\n got %x\nwant %x", what, got, want)
		}
	}
	for _, size := range []int{4096, 7, 3, 1} {
		check(t, fmt.Sprintf("one byte a read, %d asked", size),
			readAll(t, iotest.OneByteReader(bytes.NewReader(announced)), size))
		for cut := 1; cut < len(announced); cut++ {
			r := &chunkReader{chunks: [][]byte{announced[:cut], announced[cut:]}, failAfter: 1}
			check(t, fmt.Sprintf("cut at %d with an error there, %d asked", cut, size), readAll(t, r, size))
		}
	}
	random := rand.New(rand.NewPCG(1, 2))
	for range 2000 {
		r := &chunkReader{failAfter: -1}
		for rest := announced; len(rest) > 0; {
			k := min(len(rest), 1+random.IntN(20))
			r.chunks, rest = append(r.chunks, rest[:k]), rest[k:]
		}
		check(t, "random cuts", readAll(t, r, 1+random.IntN(12)))
	}
}

// errTryAgain is a read error after which reading goes on, as a timeout.
var errTryAgain = errors.New("try again")

// chunkReader returns its chunks one by one, each at most what the reader
// asks for; after the chunk failAfter (counted from 1), one read fails.
type chunkReader struct {
	chunks    [][]byte
	failAfter int
	done      int
}

func (r *chunkReader) Read(p []byte) (int, error) {
	if r.done == r.failAfter {
		r.failAfter = -1
		return 0, errTryAgain
	}
	if len(r.chunks) == 0 {
		return 0, io.EOF
	}
	n := copy(p, r.chunks[0])
	if r.chunks[0] = r.chunks[0][n:]; len(r.chunks[0]) == 0 {
		r.chunks = r.chunks[1:]
		r.done++
	}
	return n, nil
}

// TestClientSendsSmallFrames: toward a server that allows 1 MiB frames,
// our HTTP/2 client sends frames of 16 KiB, also on a tunnel opened after
// the server's settings came (x/net would size them, and the buffer it
// keeps for each tunnel, from the server's setting).
func TestClientSendsSmallFrames(t *testing.T) {
	clientSide, serverSide := net.Pipe()
	t.Cleanup(func() { clientSide.Close(); serverSide.Close() })
	client, server := batchedPair(t, clientSide, serverSide, true)
	recorded := &recordingConn{Conn: server}
	drained := make(chan int64, 2)
	go (&http2.Server{MaxReadFrameSize: 1 << 20}).ServeConn(recorded, &http2.ServeConnOpts{Handler: http.HandlerFunc(
		func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusOK)
			w.(http.Flusher).Flush()
			n, _ := io.Copy(io.Discard, r.Body)
			drained <- n
		})})
	cc, err := newHBONETransport().NewClientConn(client)
	must(t, err)
	// The first tunnel's answer comes after the server's settings.
	first := openTestTunnel(t, cc)
	first.CloseWrite()
	<-drained
	second := openTestTunnel(t, cc)
	payload := make([]byte, 200<<10)
	if _, err := second.Write(payload); err != nil {
		t.Fatal(err)
	}
	second.CloseWrite()
	if n := <-drained; n != int64(len(payload)) {
		t.Fatalf("the server read %d bytes, want %d", n, len(payload))
	}

	fr := http2.NewFramer(nil, bytes.NewReader(recorded.bytes()[len(http2.ClientPreface):]))
	largest := 0
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			break
		}
		if d, ok := f.(*http2.DataFrame); ok {
			largest = max(largest, len(d.Data()))
		}
	}
	if largest == 0 || largest > h2FrameSize {
		t.Fatalf("the largest DATA frame the client sent holds %d bytes, want 1 to %d", largest, h2FrameSize)
	}
}

// recordingConn keeps what is read from it.
type recordingConn struct {
	net.Conn
	mu   sync.Mutex
	read bytes.Buffer
}

func (c *recordingConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.mu.Lock()
	c.read.Write(p[:n])
	c.mu.Unlock()
	return n, err
}

func (c *recordingConn) bytes() []byte {
	c.mu.Lock()
	defer c.mu.Unlock()
	return bytes.Clone(c.read.Bytes())
}

// BenchmarkIdleTunnelHeap: the heap of both HTTP/2 ends per idle tunnel,
// tunnels sharing one connection to a server that allows 1 MiB frames (as
// ztunnel does), with our client's frame-size clamp and without.
func BenchmarkIdleTunnelHeap(b *testing.B) {
	for _, clamped := range []bool{true, false} {
		name := map[bool]string{true: "clamped", false: "unclamped"}[clamped]
		b.Run(name, func(b *testing.B) {
			var perTunnel float64
			for b.Loop() {
				perTunnel = idleTunnelHeap(b, clamped, 200)
			}
			b.ReportMetric(perTunnel/1024, "KiB/tunnel")
		})
	}
}

// idleTunnelHeap opens tunnels tunnels, each with one byte sent, and
// returns the heap they hold, per tunnel.
func idleTunnelHeap(b *testing.B, clamped bool, tunnels int) float64 {
	clientSide, serverSide := net.Pipe()
	defer clientSide.Close()
	defer serverSide.Close()
	client, server := batchedPair(b, clientSide, serverSide, true)
	if !clamped {
		client.clamp = nil
	}
	arrived, hold := make(chan struct{}), make(chan struct{})
	defer close(hold)
	go (&http2.Server{MaxReadFrameSize: 1 << 20, MaxConcurrentStreams: uint32(tunnels + 1)}).ServeConn(server,
		&http2.ServeConnOpts{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusOK)
			w.(http.Flusher).Flush()
			r.Body.Read(make([]byte, 1))
			arrived <- struct{}{}
			<-hold
		})})
	cc, err := newHBONETransport().NewClientConn(client)
	must(b, err)
	open := func() *clientStream {
		s := openTestTunnel(b, cc)
		if _, err := s.Write([]byte{1}); err != nil {
			b.Fatal(err)
		}
		<-arrived
		return s
	}
	// The first tunnel's answer comes after the server's settings.
	defer open().Close()
	var before, after runtime.MemStats
	runtime.GC()
	runtime.GC() // a pool keeps what it holds through one collection
	runtime.ReadMemStats(&before)
	opened := make([]*clientStream, tunnels)
	for i := range opened {
		opened[i] = open()
	}
	runtime.GC()
	runtime.GC()
	runtime.ReadMemStats(&after)
	for _, s := range opened {
		s.Close()
	}
	return float64(after.HeapInuse-before.HeapInuse) / float64(tunnels)
}

// framed is what write makes x/net's framer write.
func framed(write func(*http2.Framer)) []byte {
	var b bytes.Buffer
	write(http2.NewFramer(&b, nil))
	return b.Bytes()
}
