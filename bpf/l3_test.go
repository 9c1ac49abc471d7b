// SPDX-License-Identifier: Apache-2.0

package bpf_test

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/google/gopacket"
	"github.com/google/gopacket/layers"
	"github.com/vishvananda/netlink"

	"github.com/mtlsbridge/mtlsbridge/bpf"
	"github.com/mtlsbridge/mtlsbridge/internal/netnstest"
)

// TestNodeIngressL3: on a device without an Ethernet header (a tun, like
// Cilium's WireGuard device cilium_wg0, where packets from other nodes
// arrive decrypted in native routing), the node-ingress hook gets
// node_ingress_l3. HBONE to a local enrolled pod reaches the agent's
// interface as an Ethernet frame addressed to the agent, its IP packet
// unchanged; the rest is not steered.
func TestNodeIngressL3(t *testing.T) {
	netnstest.RequirePrivileged(t)
	ns := netnstest.NewNS(t, "mtlsb-l3")
	h := ns.Netlink(t)
	must(t, h.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "agent"}, PeerName: "agent-peer"}))
	var tun *os.File
	must(t, ns.Do(func() (err error) { tun, err = netnstest.OpenTun("wg0"); return err }))
	t.Cleanup(func() { tun.Close() })
	links := map[string]netlink.Link{}
	for _, name := range []string{"agent", "agent-peer", "wg0"} {
		l, err := h.LinkByName(name)
		must(t, err)
		must(t, h.LinkSetUp(l))
		links[name] = l
	}
	agentMAC := links["agent-peer"].Attrs().HardwareAddr

	// The node of the unit tests, its agent this namespace's veth.
	objs := loadNode(t)
	must(t, objs.Redirects.Update(bpf.AgentKey, bpf.Entry{Kind: bpf.KindAgent, Ifindex: uint32(links["agent"].Attrs().Index), MAC: agentMAC, NetnsID: bpf.NoNetns}))
	pin := filepath.Join(netnstest.BPFRoot(t), "node-ingress-wg0")
	must(t, ns.Do(func() error { return objs.Attach(bpf.HookNodeIngress, pin, links["wg0"].Attrs().Index) }))
	li, err := bpf.PinnedLink(pin)
	must(t, err)
	if info, err := objs.NodeIngressL3.Info(); err != nil {
		t.Fatal(err)
	} else if id, _ := info.ID(); li.Program != id {
		t.Fatalf("wg0 runs program %d, not node_ingress_l3 (%d)", li.Program, id)
	}

	frames := readFrames(t, ns, "agent-peer")
	for _, hbone := range []packet{
		{src: remote, dst: podA, sport: 41000, dport: 15008},
		{src: remote6, dst: podA6, sport: 41000, dport: 15008},
	} {
		plain := hbone
		plain.dport = 8080
		// In order, on one path: the plaintext packet would reach the
		// agent before the HBONE one.
		for _, p := range []packet{plain, hbone} {
			if _, err := tun.Write(p.frame()[14:]); err != nil {
				t.Fatal(err)
			}
		}
		got := nextTCP(t, frames)
		eth := got.Layer(layers.LayerTypeEthernet).(*layers.Ethernet)
		tcp := got.Layer(layers.LayerTypeTCP).(*layers.TCP)
		if tcp.DstPort != 15008 {
			t.Fatalf("the agent got TCP to port %d first: only HBONE is steered", tcp.DstPort)
		}
		wantType := layers.EthernetTypeIPv4
		if hbone.dst.Is6() {
			wantType = layers.EthernetTypeIPv6
		}
		if !bytes.Equal(eth.DstMAC, agentMAC) || eth.EthernetType != wantType {
			t.Errorf("frame to the agent: %s, type %s; want to %s, type %s", eth.DstMAC, eth.EthernetType, agentMAC, wantType)
		}
		if !bytes.Equal(eth.Payload, hbone.frame()[14:]) {
			t.Errorf("the IP packet changed on its way:\n%x\nwant\n%x", eth.Payload, hbone.frame()[14:])
		}
	}
}

// readFrames delivers the frames an interface of ns receives, until the
// test ends.
func readFrames(t *testing.T, ns *netnstest.NS, ifname string) <-chan gopacket.Packet {
	f, err := ns.PacketSocket(ifname)
	must(t, err)
	t.Cleanup(func() { f.Close() })
	out := make(chan gopacket.Packet, 64)
	go func() {
		buf := make([]byte, 1<<16)
		for {
			n, err := f.Read(buf)
			if err != nil {
				return
			}
			select {
			case out <- gopacket.NewPacket(bytes.Clone(buf[:n]), layers.LayerTypeEthernet, gopacket.Default):
			default:
			}
		}
	}()
	return out
}

// nextTCP waits for the next TCP frame (IPv6 neighbour discovery and the
// like are skipped).
func nextTCP(t *testing.T, frames <-chan gopacket.Packet) gopacket.Packet {
	t.Helper()
	timeout := time.After(5 * time.Second)
	for {
		select {
		case p := <-frames:
			if p.Layer(layers.LayerTypeTCP) != nil {
				return p
			}
		case <-timeout:
			t.Fatal("no TCP frame reached the agent's interface")
			return nil
		}
	}
}
