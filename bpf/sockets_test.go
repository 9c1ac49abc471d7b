// SPDX-License-Identifier: Apache-2.0

package bpf_test

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/mtlsbridge/mtlsbridge/bpf"
	"github.com/mtlsbridge/mtlsbridge/internal/netnstest"
)

// TestAgentConnections: packets of connections the agent holds go to the
// agent, found by a socket lookup in the agent's network namespace:
//   - from the pod, later packets of a connection the agent accepted in the
//     name of the remote destination (transparent listener);
//   - from other nodes, replies to a connection the agent opened in the
//     pod's name (transparent source).
//
// A listener there does not count, and without the namespace id nothing is
// looked up.
func TestAgentConnections(t *testing.T) {
	objs := loadNode(t)
	node, _, withNetns := agentNamespaces(t)

	const uplink = 1 // the node namespace's loopback: test runs use it
	cases := []struct {
		name    string
		prog    *ebpf.Program
		frame   []byte
		ifindex uint32
		agent   bpf.Entry
		want    uint32
		// heldBefore: the agent, its namespace known, held the
		// connection a moment before.
		heldBefore bool
	}{
		{"node ingress: reply to the agent's connection", objs.NodeIngress, packet{tcpFlags: flagACK, src: remote, dst: podA, sport: 8080, dport: 40000}.frame(), uplink, withNetns, actRedirect, false},
		{"node ingress: reply to the agent's connection, IPv6", objs.NodeIngress, packet{tcpFlags: flagACK, src: remote6, dst: podA6, sport: 8080, dport: 40000}.frame(), uplink, withNetns, actRedirect, false},
		{"node ingress: another connection of the pod", objs.NodeIngress, packet{tcpFlags: flagACK, src: remote, dst: podA, sport: 8080, dport: 40001}.frame(), uplink, withNetns, actNext, false},
		{"node ingress: to a port the agent listens on", objs.NodeIngress, packet{tcpFlags: flagACK, src: remote, dst: podA, sport: 41000, dport: 9090}.frame(), uplink, withNetns, actNext, false},
		{"from pod: later packet of a connection the agent accepted", objs.FromPod, packet{tcpFlags: flagACK, src: podA, dst: remote, sport: 41000, dport: 9443}.frame(), podAIf, withNetns, actRedirect, false},
		{"from pod: a connection the agent does not hold", objs.FromPod, packet{tcpFlags: flagACK, src: podA, dst: remote, sport: 41001, dport: 9443}.frame(), podAIf, withNetns, actNext, false},
		// Seen held by the agent just before: not the agent's now, so dropped.
		{"from pod: agent namespace unknown", objs.FromPod, packet{tcpFlags: flagACK, src: podA, dst: remote, sport: 41000, dport: 9443}.frame(), podAIf, agentNode, actShot, true},
		{"node ingress: agent namespace unknown", objs.NodeIngress, packet{tcpFlags: flagACK, src: remote, dst: podA, sport: 8080, dport: 40000}.frame(), uplink, agentNode, actNext, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if c.heldBefore {
				must(t, objs.Redirects.Update(bpf.AgentKey, withNetns))
				must(t, node.Do(func() error {
					got, _, err := runErr(c.prog, c.frame, c.ifindex)
					if err == nil && got != actRedirect {
						err = fmt.Errorf("with the agent's namespace known: verdict %d, want the agent", int32(got))
					}
					return err
				}))
			}
			must(t, objs.Redirects.Update(bpf.AgentKey, c.agent))
			var (
				got uint32
				out []byte
			)
			must(t, node.Do(func() (err error) {
				got, out, err = runErr(c.prog, c.frame, c.ifindex)
				return err
			}))
			if got != c.want {
				t.Fatalf("verdict %d, want %d", int32(got), int32(c.want))
			}
			if c.want == actRedirect && !(net.HardwareAddr(out[:6]).String() == agentMAC.String()) {
				t.Fatalf("destination MAC %s, want the agent's %s", net.HardwareAddr(out[:6]), agentMAC)
			}
		})
	}
}

// agentConnects is connectTransparent in the agent's namespace.
func agentConnects(t testing.TB, agent *netnstest.NS, local, remote netip.AddrPort) int {
	t.Helper()
	var fd int
	must(t, agent.Do(func() (err error) {
		fd, err = connectTransparent(t, local, remote)
		return err
	}))
	return fd
}

// connectTransparent opens a socket bound to local, which is not an
// address of this namespace (IP_TRANSPARENT, as an agent connecting in a
// pod's name), and starts connecting to remote without waiting. It
// returns the socket, closed at the end of the test.
func connectTransparent(t testing.TB, local, remote netip.AddrPort) (int, error) {
	family, level, opt := unix.AF_INET, unix.SOL_IP, unix.IP_TRANSPARENT
	if local.Addr().Is6() {
		family, level, opt = unix.AF_INET6, unix.SOL_IPV6, unix.IPV6_TRANSPARENT
	}
	fd, err := unix.Socket(family, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	t.Cleanup(func() { unix.Close(fd) })
	if err := unix.SetsockoptInt(fd, level, opt, 1); err != nil {
		return fd, err
	}
	if err := unix.Bind(fd, sockaddr(local)); err != nil {
		return fd, err
	}
	if err := unix.Connect(fd, sockaddr(remote)); err != nil && !errors.Is(err, unix.EINPROGRESS) {
		return fd, err
	}
	return fd, nil
}

// TestAgentSocketGone: a connection the pod opened through the agent goes
// to the agent while the agent's socket lives, and is dropped once the
// socket is gone (the agent died), not sent on to its destination in clear.
func TestAgentSocketGone(t *testing.T) {
	objs, agent, verdict := fromPodBesideAgent(t)
	conn := packet{src: podA, dst: remote, sport: 42000, dport: 9444}
	if got := verdict(conn); got != actRedirect {
		t.Fatalf("the pod's SYN: verdict %d, want the agent", int32(got))
	}
	// The agent accepts it transparently: its end is the destination.
	fd := agentConnects(t, agent, netip.AddrPortFrom(remote, 9444), netip.AddrPortFrom(podA, 42000))
	// LRU evicts the connection's entry, written at the SYN, while the
	// agent holds the connection: the next packet the agent holds puts it
	// back, or the agent's death below would let the pod's packets pass.
	evictAll(t, objs.ProxiedConnections())
	conn.tcpFlags = flagACK
	if got := verdict(conn); got != actRedirect {
		t.Fatalf("a later packet, the agent's socket open: verdict %d, want the agent", int32(got))
	}
	must(t, unix.Close(fd))
	if got := verdict(conn); got != actShot {
		t.Fatalf("a later packet, the agent's socket gone: verdict %d, want dropped", int32(got))
	}
}

// TestSimultaneousOpen: while the pod's SYN waits for an agent that does
// not answer, or that is not there at all, a SYN from the destination's
// address makes the pod answer with a SYN-ACK (simultaneous open). That
// connection was the agent's: the SYN-ACK and what follows are dropped,
// not sent in clear. So also when the agent once opened a connection to
// the pod on the same 4-tuple: the pod's SYN makes it the pod's.
func TestSimultaneousOpen(t *testing.T) {
	objs, agent, verdict := fromPodBesideAgent(t)
	opens := func(t *testing.T, syn packet, want uint32) {
		t.Helper()
		if got := verdict(syn); got != want {
			t.Fatalf("the pod's SYN: verdict %d, want %d", int32(got), int32(want))
		}
		synAck, ack := syn, syn
		synAck.tcpFlags, ack.tcpFlags = flagSYN|flagACK, flagACK
		if got := verdict(synAck); got != actShot {
			t.Fatalf("the pod's SYN-ACK to the destination: verdict %d, want dropped", int32(got))
		}
		if got := verdict(ack); got != actShot {
			t.Fatalf("the pod's next packet: verdict %d, want dropped", int32(got))
		}
	}
	t.Run("agent silent", func(t *testing.T) {
		opens(t, packet{src: podA, dst: remote, sport: 44000, dport: 9446}, actRedirect)
	})
	t.Run("after the agent's connection on the 4-tuple", func(t *testing.T) {
		syn := packet{src: podA, dst: remote, sport: 44002, dport: 9446}
		fd := agentConnects(t, agent, netip.AddrPortFrom(remote, 9446), netip.AddrPortFrom(podA, 44002))
		if got := verdict(packet{src: podA, dst: remote, sport: 44002, dport: 9446, tcpFlags: flagSYN | flagACK}); got != actRedirect {
			t.Fatalf("the pod's SYN-ACK to the agent: verdict %d, want the agent", int32(got))
		}
		must(t, unix.Close(fd))
		opens(t, syn, actRedirect)
	})
	t.Run("no agent", func(t *testing.T) {
		must(t, objs.Redirects.Delete(bpf.AgentKey))
		opens(t, packet{src: podA, dst: remote, sport: 44001, dport: 9446}, actShot)
	})
}

// TestInboundTupleReused: the pod's replies on a connection the agent
// opened to it in a remote client's name (inbound HBONE) are the agent's
// while it holds the connection, and dropped once it is gone. A later
// plaintext connection from the same client port is the pod's own: its
// SYN-ACK and what follows pass. So also when the pod once opened a
// connection of its own on that 4-tuple, before the agent's.
func TestInboundTupleReused(t *testing.T) {
	for _, outboundFirst := range []bool{false, true} {
		t.Run(fmt.Sprintf("outbound first=%v", outboundFirst), func(t *testing.T) {
			_, agent, verdict := fromPodBesideAgent(t)
			synAck := packet{src: podA, dst: remote, sport: 8443, dport: 43000, tcpFlags: flagSYN | flagACK}
			ack := synAck
			ack.tcpFlags = flagACK
			if outboundFirst {
				syn := synAck
				syn.tcpFlags = flagSYN
				if got := verdict(syn); got != actRedirect {
					t.Fatalf("the pod's own SYN: verdict %d, want the agent", int32(got))
				}
			}
			fd := agentConnects(t, agent, netip.AddrPortFrom(remote, 43000), netip.AddrPortFrom(podA, 8443))
			if got := verdict(synAck); got != actRedirect {
				t.Fatalf("the pod's SYN-ACK to the agent: verdict %d, want the agent", int32(got))
			}
			if got := verdict(ack); got != actRedirect {
				t.Fatalf("the pod's reply to the agent: verdict %d, want the agent", int32(got))
			}
			must(t, unix.Close(fd))
			if got := verdict(ack); got != actShot {
				t.Fatalf("the pod's reply, the agent's socket gone: verdict %d, want dropped", int32(got))
			}
			// The client, no longer enrolled, connects again in plaintext
			// from the same port.
			if got := verdict(synAck); got != actNext {
				t.Fatalf("the pod's SYN-ACK to a plaintext client: verdict %d, want passed", int32(got))
			}
			if got := verdict(ack); got != actNext {
				t.Fatalf("the pod's reply to a plaintext client: verdict %d, want passed", int32(got))
			}
		})
	}
}

// fromPodBesideAgent loads the programs beside an agent (agentNamespaces)
// whose namespace the map names, and returns the agent's namespace and the
// from-pod verdict on a packet of pod A.
func fromPodBesideAgent(t *testing.T) (*bpf.Objects, *netnstest.NS, func(packet) uint32) {
	objs := loadNode(t)
	node, agent, withNetns := agentNamespaces(t)
	must(t, objs.Redirects.Update(bpf.AgentKey, withNetns))
	return objs, agent, func(p packet) uint32 {
		var got uint32
		must(t, node.Do(func() (err error) {
			got, _, err = runErr(objs.FromPod, p.frame(), podAIf)
			return err
		}))
		return got
	}
}

// evictAll deletes every entry of m.
func evictAll(t *testing.T, m *ebpf.Map) {
	t.Helper()
	var key []byte
	var keys [][]byte
	for it := m.Iterate(); it.Next(&key, new([]byte)); {
		keys = append(keys, append([]byte(nil), key...))
	}
	for _, k := range keys {
		must(t, m.Delete(k))
	}
	if len(keys) == 0 {
		t.Fatal("no proxied connection to evict: the SYN was not recorded")
	}
}

func sockaddr(ap netip.AddrPort) unix.Sockaddr {
	if ap.Addr().Is4() {
		return &unix.SockaddrInet4{Addr: ap.Addr().As4(), Port: int(ap.Port())}
	}
	return &unix.SockaddrInet6{Addr: ap.Addr().As16(), Port: int(ap.Port())}
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// agentNamespaces sets up a node namespace and an agent namespace, which
// the node knows by an id, holding connections of the agent in pod A's and
// the remote's names. It returns the node namespace and the agent's entry
// with that id.
func agentNamespaces(t testing.TB) (node, agent *netnstest.NS, withNetns bpf.Entry) {
	node = netnstest.NewNS(t, "mtlsb-node")
	agent = netnstest.NewNS(t, "mtlsb-agent")
	// The agent's namespace: a route to the remote range into a veth pair
	// that goes nowhere, so that connecting sends a SYN nobody answers and
	// leaves the socket in SYN_SENT, as while waiting for the reply.
	ah := agent.Netlink(t)
	must(t, ah.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "void0"}, PeerName: "void1"}))
	dummy, err := ah.LinkByName("void0")
	must(t, err)
	must(t, ah.LinkSetUp(dummy))
	for _, cidr := range []string{"10.1.0.0/16", "fd00:1::/64", "10.2.0.0/16", "fd00:2::/64"} {
		_, dst, _ := net.ParseCIDR(cidr)
		must(t, ah.RouteAdd(&netlink.Route{Dst: dst, LinkIndex: dummy.Attrs().Index}))
	}
	must(t, agent.Do(func() error {
		for _, c := range []struct{ local, remote netip.AddrPort }{
			{netip.AddrPortFrom(podA, 40000), netip.AddrPortFrom(remote, 8080)},
			{netip.AddrPortFrom(podA6, 40000), netip.AddrPortFrom(remote6, 8080)},
			// As accepted from pod A: the agent's end is the destination.
			{netip.AddrPortFrom(remote, 9443), netip.AddrPortFrom(podA, 41000)},
		} {
			if _, err := connectTransparent(t, c.local, c.remote); err != nil {
				return err
			}
		}
		return nil
	}))
	var listener net.Listener
	must(t, agent.Do(func() (err error) {
		listener, err = net.Listen("tcp4", "0.0.0.0:9090")
		return err
	}))
	t.Cleanup(func() { listener.Close() })

	// The node names the agent's namespace with an id, as it does for the
	// peer of a veth pair.
	const nsid = 7
	must(t, node.Netlink(t).SetNetNsIdByFd(int(agent.Handle), nsid))
	withNetns = agentNode
	withNetns.NetnsID = nsid
	return node, agent, withNetns
}
