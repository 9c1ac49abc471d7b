// SPDX-License-Identifier: Apache-2.0

package bpf_test

import (
	"bytes"
	"net"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/mtlsbridge/mtlsbridge/bpf"
	"github.com/mtlsbridge/mtlsbridge/internal/netnstest"
)

// Program verdicts (linux/pkt_cls.h).
const (
	actNext     = ^uint32(0) // TC_ACT_UNSPEC (-1): on to the next TCX program
	actShot     = 2          // TC_ACT_SHOT
	actRedirect = 7          // TC_ACT_REDIRECT
)

// The node of these tests: pod A is enrolled (on interface 11), pod N is
// not, the node owns 192.168.100.1, and the agent sits behind interface 99.
var (
	podA      = netip.MustParseAddr("10.1.0.10")
	podA6     = netip.MustParseAddr("fd00:1::10")
	podN      = netip.MustParseAddr("10.1.0.11")
	podN6     = netip.MustParseAddr("fd00:1::11")
	nodeIP    = netip.MustParseAddr("192.168.100.1")
	agentIP   = netip.MustParseAddr("10.1.0.2")
	remote    = netip.MustParseAddr("10.2.0.20")
	remote6   = netip.MustParseAddr("fd00:2::20")
	podAIf    = uint32(11)
	podNIf    = uint32(12)
	agentIf   = uint32(99)
	agentMAC  = net.HardwareAddr{0x02, 0, 0, 0, 0, 0x99}
	agentNode = bpf.Entry{Kind: bpf.KindAgent, Ifindex: agentIf, MAC: agentMAC, NetnsID: bpf.NoNetns}
)

func loadNode(t testing.TB) *bpf.Objects {
	t.Helper()
	netnstest.RequirePrivileged(t)
	objs, err := bpf.Load("")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { objs.Close() })
	entries := map[netip.Addr]bpf.Entry{
		podA:         {Kind: bpf.KindEnrolled, Ifindex: podAIf, MAC: podMAC, NetnsID: bpf.NoNetns},
		podA6:        {Kind: bpf.KindEnrolled, Ifindex: podAIf, MAC: podMAC, NetnsID: bpf.NoNetns},
		podN:         {Kind: bpf.KindLocal, NetnsID: bpf.NoNetns},
		podN6:        {Kind: bpf.KindLocal, NetnsID: bpf.NoNetns},
		nodeIP:       {Kind: bpf.KindLocal, NetnsID: bpf.NoNetns},
		agentIP:      {Kind: bpf.KindLocal, NetnsID: bpf.NoNetns},
		bpf.AgentKey: agentNode,
	}
	for addr, e := range entries {
		if err := objs.Redirects.Update(addr, e); err != nil {
			t.Fatal(err)
		}
	}
	return objs
}

func run(t testing.TB, prog *ebpf.Program, frame []byte, ingressIfindex uint32) (uint32, []byte) {
	t.Helper()
	ret, out, err := runErr(prog, frame, ingressIfindex)
	if err != nil {
		t.Fatal(err)
	}
	return ret, out
}

// runErr runs prog once on frame, in the network namespace of the calling
// thread, as if it came in on ingressIfindex.
func runErr(prog *ebpf.Program, frame []byte, ingressIfindex uint32) (uint32, []byte, error) {
	opts := ebpf.RunOptions{
		Data:    frame,
		DataOut: make([]byte, len(frame)+256),
		Context: skbContext{IngressIfindex: ingressIfindex},
	}
	ret, err := prog.Run(&opts)
	return ret, opts.DataOut, err
}

type decision struct {
	name    string
	frame   []byte
	ifindex uint32
	want    uint32
}

// check runs each case and, beyond the verdict, checks the frame: a
// redirected one carries the agent's MAC and is otherwise untouched (the
// original destination stays for the agent to read), any other is not
// modified at all.
func check(t *testing.T, prog *ebpf.Program, cases []decision) {
	t.Helper()
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, out := run(t, prog, c.frame, c.ifindex)
			if got != c.want {
				t.Fatalf("verdict %d, want %d", int32(got), int32(c.want))
			}
			want := c.frame
			if c.want == actRedirect {
				want = append(append([]byte{}, agentMAC...), c.frame[6:]...)
			}
			if !bytes.Equal(out, want) {
				t.Fatalf("frame out\n%x\nwant\n%x", out, want)
			}
		})
	}
}

// TestFromPod checks the from-pod decisions: only TCP from an enrolled pod,
// on its own interface, to an address that is not on this node, goes to
// the agent: new connections always, later packets when the agent holds
// their connection (TestAgentConnections).
func TestFromPod(t *testing.T) {
	objs := loadNode(t)
	check(t, objs.FromPod, []decision{
		{"enrolled to remote", packet{src: podA, dst: remote, sport: 40000, dport: 8080}.frame(), podAIf, actRedirect},
		{"enrolled to remote, a connection older than the redirect", packet{src: podA, dst: remote, sport: 39000, dport: 8080, tcpFlags: flagACK}.frame(), podAIf, actNext},
		{"enrolled to remote, reply to a client of the pod", packet{src: podA, dst: remote, sport: 8080, dport: 40000, tcpFlags: flagSYN | flagACK}.frame(), podAIf, actNext},
		{"enrolled to remote, IPv6", packet{src: podA6, dst: remote6, sport: 40000, dport: 8080}.frame(), podAIf, actRedirect},
		{"enrolled to remote, IPv6 extension header", packet{src: podA6, dst: remote6, sport: 40000, dport: 8080, extHeaders: 1}.frame(), podAIf, actRedirect},
		{"enrolled to remote, IPv6 four extension headers", packet{src: podA6, dst: remote6, sport: 40000, dport: 8080, extHeaders: 4}.frame(), podAIf, actRedirect},
		// The AH's length counts differently: a misread would lose the
		// ports, and a packet without them is steered.
		{"enrolled to remote, authentication header", packet{src: podA, dst: remote, sport: 40000, dport: 8080, authHeader: true}.frame(), podAIf, actRedirect},
		{"enrolled to remote, authentication header, not a new connection", packet{src: podA, dst: remote, sport: 39000, dport: 8080, authHeader: true, tcpFlags: flagACK}.frame(), podAIf, actNext},
		{"enrolled to remote, IPv6 authentication header", packet{src: podA6, dst: remote6, sport: 40000, dport: 8080, extHeaders: 2, authHeader: true}.frame(), podAIf, actRedirect},
		{"enrolled to remote, IPv6 authentication header, not a new connection", packet{src: podA6, dst: remote6, sport: 39000, dport: 8080, authHeader: true, tcpFlags: flagACK}.frame(), podAIf, actNext},
		{"enrolled to remote, IPv6 too many extension headers", packet{src: podA6, dst: remote6, sport: 40000, dport: 8080, extHeaders: 5}.frame(), podAIf, actShot},
		{"enrolled to a local pod, IPv6 too many extension headers", packet{src: podA6, dst: podN6, sport: 40000, dport: 8080, extHeaders: 5}.frame(), podAIf, actNext},
		{"not enrolled, IPv6 too many extension headers", packet{src: podN6, dst: remote6, sport: 40000, dport: 8080, extHeaders: 5}.frame(), podNIf, actNext},
		{"enrolled to remote, later IPv4 fragment", packet{src: podA, dst: remote, laterFragment: true}.frame(), podAIf, actRedirect},
		{"enrolled source on another interface", packet{src: podA, dst: remote, sport: 40000, dport: 8080}.frame(), podNIf, actNext},
		{"not enrolled to remote", packet{src: podN, dst: remote, sport: 40000, dport: 8080}.frame(), podNIf, actNext},
		{"not enrolled to remote, IPv6", packet{src: podN6, dst: remote6, sport: 40000, dport: 8080}.frame(), podNIf, actNext},
		{"enrolled to a local pod", packet{src: podA, dst: podN, sport: 40000, dport: 8080}.frame(), podAIf, actNext},
		{"enrolled to a local pod, IPv6", packet{src: podA6, dst: podN6, sport: 40000, dport: 8080}.frame(), podAIf, actNext},
		{"enrolled to the node", packet{src: podA, dst: nodeIP, sport: 40000, dport: 10250}.frame(), podAIf, actNext},
		{"enrolled to the agent pod", packet{src: podA, dst: agentIP, sport: 40000, dport: 15000}.frame(), podAIf, actNext},
		{"enrolled, UDP", packet{src: podA, dst: remote, sport: 40000, dport: 53, proto: protoUDP}.frame(), podAIf, actNext},
		{"enrolled, ICMP", packet{src: podA, dst: remote, proto: protoICMP}.frame(), podAIf, actNext},
		{"ARP", arpFrame(), podAIf, actNext},
		{"truncated TCP header", packet{src: podA, dst: remote, sport: 40000, dport: 8080}.frame()[:14+20+10], podAIf, actRedirect},
	})
}

// TestFromPodFailsClosed: with no agent entry, an enrolled pod cannot open
// a cross-node connection in plaintext; everything else still passes.
func TestFromPodFailsClosed(t *testing.T) {
	objs := loadNode(t)
	if err := objs.Redirects.Delete(bpf.AgentKey); err != nil {
		t.Fatal(err)
	}
	check(t, objs.FromPod, []decision{
		{"enrolled to remote, new connection", packet{src: podA, dst: remote, sport: 40000, dport: 8080}.frame(), podAIf, actShot},
		{"enrolled to remote, later IPv4 fragment", packet{src: podA, dst: remote, laterFragment: true}.frame(), podAIf, actShot},
		{"enrolled to remote, later IPv6 fragment", packet{src: podA6, dst: remote6, laterFragment: true}.frame(), podAIf, actShot},
		// Destination options after the fragment header: the first
		// fragment holds them and the TCP header, this one TCP payload.
		{"enrolled to remote, later IPv6 fragment, options first", packet{src: podA6, dst: remote6, laterFragment: true, fragmentNext: 60}.frame(), podAIf, actShot},
		{"enrolled to remote, later IPv4 fragment behind AH", packet{src: podA, dst: remote, laterFragment: true, proto: protoAH}.frame(), podAIf, actShot},
		{"enrolled to remote, later IPv6 fragment, AH first", packet{src: podA6, dst: remote6, laterFragment: true, fragmentNext: protoAH}.frame(), podAIf, actShot},
		{"enrolled to remote, a connection older than the redirect", packet{src: podA, dst: remote, sport: 40010, dport: 8080, tcpFlags: flagACK}.frame(), podAIf, actNext},
		// The 4-tuple of the SYN dropped above: not older than the redirect.
		{"enrolled to remote, a later packet of the dropped SYN's connection", packet{src: podA, dst: remote, sport: 40000, dport: 8080, tcpFlags: flagACK}.frame(), podAIf, actShot},
		{"enrolled to a local pod", packet{src: podA, dst: podN, sport: 40000, dport: 8080}.frame(), podAIf, actNext},
		{"not enrolled to remote", packet{src: podN, dst: remote, sport: 40000, dport: 8080}.frame(), podNIf, actNext},
	})
}

// TestFromPodAgentGone: a connection the pod opened through an agent that no
// longer holds it (the agent died, or came back in a new namespace) never
// goes on to its real destination, in clear, as, say, the next request on
// a pooled connection would. Connections no agent ever held still pass.
func TestFromPodAgentGone(t *testing.T) {
	objs := loadNode(t)
	opened := packet{src: podA, dst: remote, sport: 40001, dport: 8080}
	opened6 := packet{src: podA6, dst: remote6, sport: 40001, dport: 8080}
	check(t, objs.FromPod, []decision{
		{"opened through the agent", opened.frame(), podAIf, actRedirect},
		{"opened through the agent, IPv6", opened6.frame(), podAIf, actRedirect},
	})
	// The agent's namespace holds none of them (this test's agent has no
	// namespace: as after it restarted in a new one).
	opened.tcpFlags, opened6.tcpFlags = flagACK, flagACK
	reply := packet{src: podA, dst: remote, sport: 8080, dport: 40001, tcpFlags: flagACK}
	check(t, objs.FromPod, []decision{
		{"a later packet", opened.frame(), podAIf, actShot},
		{"a later packet, IPv6", opened6.frame(), podAIf, actShot},
		{"the reverse tuple: a plaintext client's connection", reply.frame(), podAIf, actNext},
		{"another port: a connection older than the redirect", packet{src: podA, dst: remote, sport: 40002, dport: 8080, tcpFlags: flagACK}.frame(), podAIf, actNext},
	})
	if err := objs.Redirects.Delete(bpf.AgentKey); err != nil {
		t.Fatal(err)
	}
	check(t, objs.FromPod, []decision{
		{"a later packet, no agent at all", opened.frame(), podAIf, actShot},
		{"a connection no agent held, no agent at all", reply.frame(), podAIf, actNext},
	})
}

// TestNodeIngress checks the uplink decisions: HBONE to a local enrolled pod
// goes to the agent; other traffic to it, and anything to other addresses,
// passes.
func TestNodeIngress(t *testing.T) {
	objs := loadNode(t)
	const uplink = 2
	check(t, objs.NodeIngress, []decision{
		{"HBONE to enrolled", packet{src: remote, dst: podA, sport: 41000, dport: 15008}.frame(), uplink, actRedirect},
		{"HBONE to enrolled, IPv6", packet{src: remote6, dst: podA6, sport: 41000, dport: 15008}.frame(), uplink, actRedirect},
		{"HBONE to enrolled, IPv6 extension header", packet{src: remote6, dst: podA6, sport: 41000, dport: 15008, extHeaders: 1}.frame(), uplink, actRedirect},
		{"plaintext to enrolled, no agent connection", packet{src: remote, dst: podA, sport: 41000, dport: 8080}.frame(), uplink, actNext},
		{"HBONE to not enrolled", packet{src: remote, dst: podN, sport: 41000, dport: 15008}.frame(), uplink, actNext},
		{"HBONE to the node", packet{src: remote, dst: nodeIP, sport: 41000, dport: 15008}.frame(), uplink, actNext},
		{"HBONE to enrolled, IPv6 too many extension headers", packet{src: remote6, dst: podA6, sport: 41000, dport: 15008, extHeaders: 5}.frame(), uplink, actNext},
		{"UDP 15008 to enrolled", packet{src: remote, dst: podA, sport: 41000, dport: 15008, proto: protoUDP}.frame(), uplink, actNext},
		{"later fragment to enrolled", packet{src: remote, dst: podA, laterFragment: true}.frame(), uplink, actNext},
	})

	if err := objs.Redirects.Delete(bpf.AgentKey); err != nil {
		t.Fatal(err)
	}
	check(t, objs.NodeIngress, []decision{
		{"HBONE to enrolled without agent", packet{src: remote, dst: podA, sport: 41000, dport: 15008}.frame(), uplink, actNext},
	})
}
