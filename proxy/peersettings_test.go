// SPDX-License-Identifier: Apache-2.0

package proxy

import (
	"bytes"
	"errors"
	"io"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"testing"
	"testing/iotest"

	"golang.org/x/net/http2"
)

// TestFrameSizeClamp: every frame size a server announces above 16 KiB
// reads as 16 KiB, and nothing else changes, however the reads cut the
// frames and whatever size the reader asks for.
func TestFrameSizeClamp(t *testing.T) {
	stream := func(large, other uint32) []byte {
		var b bytes.Buffer
		f := http2.NewFramer(&b, nil)
		f.WriteSettings(http2.Setting{ID: http2.SettingHeaderTableSize, Val: 1 << 20},
			http2.Setting{ID: http2.SettingMaxFrameSize, Val: large})
		// Data that reads like a frame-size setting must stay as it is.
		f.WriteData(1, false, bytes.Repeat([]byte{0, 5, 0, 16, 0, 0}, 20))
		f.WriteSettingsAck()
		f.WriteSettings(http2.Setting{ID: http2.SettingMaxFrameSize, Val: h2FrameSize},
			http2.Setting{ID: http2.SettingMaxFrameSize, Val: other})
		f.WriteWindowUpdate(0, 1<<20)
		return b.Bytes()
	}
	announced, want := stream(1<<20, 20000), stream(h2FrameSize, h2FrameSize)

	readAll := func(r io.Reader, size int) []byte {
		var c frameSizeClamp
		var out []byte
		p := make([]byte, size)
		for {
			n, err := c.read(r, p)
			out = append(out, p[:n]...)
			if errors.Is(err, io.EOF) {
				return out
			}
			if err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, size := range []int{4096, 7, 3, 1} {
		if got := readAll(iotest.OneByteReader(bytes.NewReader(announced)), size); !bytes.Equal(got, want) {
			t.Fatalf("one byte a read, reading %d at a time:\n got %x\nwant %x", size, got, want)
		}
		for cut := 1; cut < len(announced); cut++ {
			r := io.MultiReader(bytes.NewReader(announced[:cut]), bytes.NewReader(announced[cut:]))
			if got := readAll(r, size); !bytes.Equal(got, want) {
				t.Fatalf("cut at %d, reading %d at a time:\n got %x\nwant %x", cut, size, got, want)
			}
		}
	}
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
	src := forwardedFor(netip.MustParseAddrPort("10.0.0.2:1234"))
	// The first tunnel's answer comes after the server's settings.
	first, err := openTunnel(cc, "10.0.0.1:80", src)
	must(t, err)
	first.CloseWrite()
	<-drained
	second, err := openTunnel(cc, "10.0.0.1:80", src)
	must(t, err)
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
