// SPDX-License-Identifier: Apache-2.0

package proxy

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
	"istio.io/istio/pkg/zdsapi"

	"github.com/mtlsbridge/mtlsbridge/internal/netnstest"
	"github.com/mtlsbridge/mtlsbridge/internal/syncbuf"
)

// TestInPodSelfCalls: in the in-pod mode the proxy listens in each pod
// on all addresses. A connection to the pod's address on one of those
// ports is a call to the proxy itself; served like any other, it would go
// to the same listener again, each turn taking one of the node's slots
// until none is left for any pod. It is refused at once, as ztunnel
// refuses its illegal ports.
func TestInPodSelfCalls(t *testing.T) {
	for _, tc := range []struct {
		name      string
		from      string
		port      uint16
		direction string
	}{
		// Anyone who can reach the pod, no certificate needed.
		{"plain client to the pod's 15006", "client", InboundPlainPort, DirectionInbound},
		// The pod itself, over lo (not redirected).
		{"the pod to its own 15001", "pod", OutboundPort, DirectionOutbound},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, ns, podIP, clientIP := inPodSetup(t)
			from := map[string]netip.Addr{"client": clientIP, "pod": podIP}[tc.from]
			var c net.Conn
			err := ns.Do(func() (err error) {
				d := net.Dialer{LocalAddr: &net.TCPAddr{IP: from.AsSlice()}, Timeout: 2 * time.Second}
				c, err = d.Dial("tcp4", netip.AddrPortFrom(podIP, tc.port).String())
				return err
			})
			// On loopback the reset may come before the dial has seen its
			// connection made.
			if err == nil {
				defer c.Close()
				c.SetReadDeadline(time.Now().Add(5 * time.Second))
				var b []byte
				b, err = io.ReadAll(c)
				if len(b) > 0 {
					t.Errorf("the self-call read %q", b)
				}
			}
			if !errors.Is(err, unix.ECONNRESET) {
				t.Errorf("the self-call ended with %v; want a reset", err)
			}
			eventually(t, func() bool { return testutil.ToFloat64(p.metrics.Refused.WithLabelValues(tc.direction, "loop")) == 1 },
				"the self-call refused as a loop")
			opened := testutil.ToFloat64(p.metrics.ConnectionsOpened.WithLabelValues(tc.direction, ProtocolPlain))
			overloaded := testutil.ToFloat64(p.metrics.Refused.WithLabelValues(tc.direction, "overloaded"))
			if opened > 0 || overloaded > 0 {
				t.Errorf("one self-call opened %v connections through the proxy, %v refused as overloaded", opened, overloaded)
			}
			eventually(t, func() bool { return len(p.inboundSlots)+len(p.outboundSlots) == 0 }, "no slot held")
		})
	}
}

// inPodSetup: a pod namespace (pod 10.99.0.10, a plain client 10.99.0.20,
// both on its loopback) with the in-pod NAT, served by a proxy in the
// in-pod mode as ZDS would hand it over; the node's slot bounds (16384)
// lowered to 64 to keep the test small.
func inPodSetup(t *testing.T) (*Proxy, *netnstest.NS, netip.Addr, netip.Addr) {
	netnstest.RequirePrivileged(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)

	podIP, clientIP := netip.MustParseAddr("10.99.0.10"), netip.MustParseAddr("10.99.0.20")
	ns := netnstest.NewNS(t, "selfcall")
	nl := ns.Netlink(t)
	lo, err := nl.LinkByName("lo")
	must(t, err)
	for _, a := range []netip.Addr{podIP, clientIP} {
		must(t, nl.AddrAdd(lo, &netlink.Addr{IPNet: &net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(32, 32)}}))
	}
	inPodNAT(t, ns)

	p := New(Config{NodeName: "node-a", TrustDomain: "cluster.local", IdleTimeout: time.Minute},
		slog.New(slog.NewTextHandler(&syncbuf.Buffer{}, nil)))
	p.inboundSlots, p.outboundSlots = make(chan struct{}, 64), make(chan struct{}, 64)
	p.state.putWorkload("pod", &Workload{UID: "pod", Name: "pod", Namespace: "app", Node: "node-a",
		Identity: "spiffe://cluster.local/ns/app/sa/default", Addresses: []netip.Addr{podIP}, HBONE: true})
	markSynced(p)
	p.inpod = newInPod(ctx, p)
	t.Cleanup(p.inpod.stopAll)
	f, err := os.Open(filepath.Join("/var/run/netns", ns.Name))
	must(t, err)
	must(t, p.inpod.Add("pod", &zdsapi.WorkloadInfo{Name: "pod", Namespace: "app", ServiceAccount: "default"}, f))
	return p, ns, podIP, clientIP
}

// inPodNAT writes the node agent's in-pod NAT chains that matter here into
// ns (reconcilers/inpod/rules.go: prerouting redirect to 15006 unless
// 15008 or the proxy's mark; output: lo accepted): the namespace then
// tracks connections, as every in-pod pod's does, so SO_ORIGINAL_DST
// answers.
func inPodNAT(t *testing.T, ns *netnstest.NS) {
	conn, err := nftables.New(nftables.WithNetNSFd(int(ns.Handle)))
	must(t, err)
	table := conn.AddTable(&nftables.Table{Name: "rv-inpod", Family: nftables.TableFamilyINet})
	pre := conn.AddChain(&nftables.Chain{Name: "prerouting-nat", Table: table, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookPrerouting, Priority: nftables.ChainPriorityNATDest})
	out := conn.AddChain(&nftables.Chain{Name: "output-nat", Table: table, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookOutput, Priority: nftables.ChainPriorityNATDest})
	lo := make([]byte, 16)
	copy(lo, "lo")
	conn.AddRule(&nftables.Rule{Table: table, Chain: out, Exprs: []expr.Any{
		&expr.Meta{Key: expr.MetaKeyOIFNAME, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: lo},
		&expr.Verdict{Kind: expr.VerdictAccept},
	}})
	conn.AddRule(&nftables.Rule{Table: table, Chain: pre, Exprs: []expr.Any{
		&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.NFPROTO_IPV4}},
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.IPPROTO_TCP}},
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: binaryutil.BigEndian.PutUint16(HBONEPort)},
		&expr.Meta{Key: expr.MetaKeyMARK, Register: 1},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4,
			Mask: binaryutil.NativeEndian.PutUint32(0xfff), Xor: binaryutil.NativeEndian.PutUint32(0)},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: binaryutil.NativeEndian.PutUint32(PacketMark)},
		&expr.Immediate{Register: 1, Data: binaryutil.BigEndian.PutUint16(InboundPlainPort)},
		&expr.Redir{RegisterProtoMin: 1, RegisterProtoMax: 1, Flags: unix.NF_NAT_RANGE_PROTO_SPECIFIED},
	}})
	must(t, conn.Flush())
}
