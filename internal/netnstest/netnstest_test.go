// SPDX-License-Identifier: Apache-2.0

package netnstest_test

import (
	"cmp"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/mtlsbridge/mtlsbridge/internal/netnstest"
)

// TestTopology: pods reach each other over IPv4 and IPv6, across nodes and
// on one node, with the addresses they were given, from the moment they
// exist: not one SYN needs to go twice. In the tunnel routing modes,
// pods' segments cross the tunnel devices and never the uplinks in clear.
func TestTopology(t *testing.T) {
	netnstest.RequirePrivileged(t)
	for _, tunnel := range []netnstest.Tunnel{"", netnstest.TunnelVXLAN, netnstest.TunnelGeneve} {
		t.Run(cmp.Or(string(tunnel), "native"), func(t *testing.T) {
			var n1, n2 *netnstest.Node
			if tunnel != "" {
				n1, n2 = netnstest.NewTunnelNodes(t, tunnel)
			} else {
				n1, n2 = netnstest.NewNodes(t)
			}
			uplink := n1.Capture(t, netnstest.UplinkName)
			var tunnelled *netnstest.Capture
			if tunnel != "" {
				tunnelled = n1.Capture(t, tunnel.Device())
			}
			a := n1.AddPod(t, "a")
			b := n1.AddPod(t, "b")
			r := n2.AddPod(t, "r")
			for _, p := range []*netnstest.Pod{a, b, r} {
				p.Serve(t, p.Name, 8080, false, p.IP4, p.IP6)
			}
			for _, c := range []struct {
				from, to *netnstest.Pod
			}{{a, r}, {r, a}, {a, b}} {
				for _, dst := range []netip.Addr{c.to.IP4, c.to.IP6} {
					ans, err := c.from.Ask(netip.AddrPortFrom(dst, 8080))
					if err != nil {
						t.Fatalf("%s -> %s: %v", c.from.Name, dst, err)
					}
					src := c.from.IP4
					if dst.Is6() {
						src = c.from.IP6
					}
					if ans.Server != c.to.Name || ans.Remote.Addr() != src {
						t.Fatalf("%s -> %s: answered by %s", c.from.Name, dst, ans)
					}
				}
			}
			for _, p := range []*netnstest.Pod{a, b, r} {
				if n := synRetransmits(t, p); n != 0 {
					t.Errorf("%s retransmitted %d SYNs or SYN-ACKs: a packet was lost", p.Name, n)
				}
			}
			// Two flows each way across nodes (a and r, both families).
			wantOnUplink, wantTunnelled := 4, 0
			if tunnel != "" {
				wantOnUplink, wantTunnelled = 0, 4
			}
			if got := crossNodeFlows(uplink, r); got != wantOnUplink {
				t.Errorf("%d flows with r in clear on the uplink, want %d", got, wantOnUplink)
			}
			if tunnel != "" {
				if got := crossNodeFlows(tunnelled, r); got != wantTunnelled {
					t.Errorf("%d flows with r on %s, want %d", got, tunnel.Device(), wantTunnelled)
				}
			}
		})
	}
}

// crossNodeFlows counts the SYNs of connections from or to pod r that the
// capture saw.
func crossNodeFlows(c *netnstest.Capture, r *netnstest.Pod) int {
	n := 0
	for _, s := range c.Segments() {
		if s.SYN && !s.ACK && (s.Src.Addr() == r.IP4 || s.Src.Addr() == r.IP6 || s.Dst.Addr() == r.IP4 || s.Dst.Addr() == r.IP6) {
			n++
		}
	}
	return n
}

// synRetransmits reads TcpExt TCPSynRetrans (SYNs and SYN-ACKs sent again)
// of the pod's namespace.
func synRetransmits(t *testing.T, p *netnstest.Pod) int {
	var netstat []byte
	err := p.Do(func() (err error) {
		netstat, err = os.ReadFile("/proc/thread-self/net/netstat")
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for line := range strings.Lines(string(netstat)) {
		fields := strings.Fields(line)
		if len(fields) == 0 || fields[0] != "TcpExt:" {
			continue
		}
		if names == nil {
			names = fields
			continue
		}
		if i := slices.Index(names, "TCPSynRetrans"); i > 0 && i < len(fields) {
			n, err := strconv.Atoi(fields[i])
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	t.Fatalf("no TCPSynRetrans in %s's netstat", p.Name)
	return 0
}
