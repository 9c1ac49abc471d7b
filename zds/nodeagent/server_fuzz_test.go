// SPDX-License-Identifier: Apache-2.0

package nodeagent_test

import (
	"bytes"
	"net"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	"istio.io/istio/pkg/zdsapi"
)

// packetSeparator splits a fuzz input into the packets a client sends.
var packetSeparator = []byte("\x00|\x00")

// FuzzClientMessages plays a ZDS client that sends arbitrary packets (who
// can reach the socket writes them): its hello and its answers to the
// server's requests, read between packets. The server must never panic,
// must drop a client that breaks the protocol or says nothing, and must
// then serve a real ztunnel the pod it holds. The server accepts 5
// connections a second, so this runs about 5 inputs a second. Seeds:
// below. Long runs: make fuzz.
func FuzzClientMessages(f *testing.F) {
	marshal := func(m proto.Message) []byte {
		b, err := proto.Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		return b
	}
	hello := marshal(&zdsapi.ZdsHello{Version: zdsapi.Version_V1})
	ack := marshal(&zdsapi.WorkloadResponse{Payload: &zdsapi.WorkloadResponse_Ack{Ack: &zdsapi.Ack{}}})
	nack := marshal(&zdsapi.WorkloadResponse{Payload: &zdsapi.WorkloadResponse_Ack{Ack: &zdsapi.Ack{Error: "no"}}})
	join := func(packets ...[]byte) []byte { return bytes.Join(packets, packetSeparator) }
	f.Add(join(hello, ack, ack))
	f.Add(join(hello, nack, ack))
	f.Add(join(hello, hello, ack))
	f.Add(join(hello, []byte{}, ack))
	f.Add(join(hello, []byte{0x0a, 0x80, 0x80, 0x80, 0x80, 0x08}))
	f.Add(join(marshal(&zdsapi.ZdsHello{Version: zdsapi.Version_NOT_USED}), ack))
	f.Add(join(append(hello, 0xff, 0xff), ack))
	f.Add([]byte{})

	f.Fuzz(func(t *testing.T, input []byte) {
		fx := newFixture(t, 200*time.Millisecond)
		fx.put("app/a", fx.netns)
		c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: fx.path, Net: "unixpacket"})
		if err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 4096)
		for i, packet := range bytes.Split(input, packetSeparator) {
			if i == 8 {
				break
			}
			if _, err := c.Write(packet); err != nil {
				break // the server hung up
			}
			// Whatever the server sends next; with no room for control
			// messages, the kernel closes the descriptors it carries.
			c.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
			c.Read(buf)
		}
		c.Close()
		z := startZtunnel(t, fx.path)
		fx.wantServing(z, "uid-a app/a sa=sa-a")
		fx.wantStates("app/a acked ")
	})
}
