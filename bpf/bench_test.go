// SPDX-License-Identifier: Apache-2.0

package bpf_test

import (
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"

	"github.com/mtlsbridge/mtlsbridge/bpf"
	"github.com/mtlsbridge/mtlsbridge/internal/netnstest"
)

// Nanoseconds per packet of each program, redirect vs pass, measured with
// BPF_PROG_TEST_RUN repeating the program b.N times in the kernel (one
// syscall): ns/op is the cost of one packet, map lookups included. The
// from-pod redirect cases repeat one SYN: after the first, its connection
// is in proxied_map, so they measure a retransmitted SYN (the decision,
// the lookup in proxied_map, the steering). A new connection's SYN also
// inserts its entry, once per connection: BenchmarkFloor/lru-insert-new.
//
//	go test -run '^$' -bench . ./bpf/
func BenchmarkFromPod(b *testing.B) {
	objs := loadNode(b)
	bench(b, objs.FromPod, []decision{
		{"redirect", packet{src: podA, dst: remote, sport: 40000, dport: 8080}.frame(), podAIf, actRedirect},
		{"redirect-ipv6", packet{src: podA6, dst: remote6, sport: 40000, dport: 8080}.frame(), podAIf, actRedirect},
		{"pass-not-enrolled", packet{src: podN, dst: remote, sport: 40000, dport: 8080}.frame(), podNIf, actNext},
		{"pass-same-node", packet{src: podA, dst: podN, sport: 40000, dport: 8080}.frame(), podAIf, actNext},
		{"pass-udp", packet{src: podA, dst: remote, sport: 40000, dport: 53, proto: protoUDP}.frame(), podAIf, actNext},
	})
}

func BenchmarkNodeIngress(b *testing.B) {
	objs := loadNode(b)
	bench(b, objs.NodeIngress, []decision{
		{"redirect-hbone", packet{src: remote, dst: podA, sport: 41000, dport: 15008}.frame(), 2, actRedirect},
		{"pass-not-enrolled", packet{src: remote, dst: podN, sport: 41000, dport: 15008}.frame(), 2, actNext},
		{"pass-enrolled-plaintext", packet{src: remote, dst: podA, sport: 41000, dport: 8080}.frame(), 2, actNext},
	})
}

func bench(b *testing.B, prog *ebpf.Program, cases []decision) {
	for _, c := range cases {
		b.Run(c.name, func(b *testing.B) {
			// Check the verdict once, outside the measurement.
			if got, _ := run(b, prog, c.frame, c.ifindex); got != c.want {
				b.Fatalf("verdict %d, want %d", int32(got), int32(c.want))
			}
			opts := ebpf.RunOptions{
				Data:    c.frame,
				Context: skbContext{IngressIfindex: c.ifindex},
				Repeat:  uint32(b.N),
				Reset:   b.ResetTimer,
			}
			b.ResetTimer()
			if _, err := prog.Run(&opts); err != nil {
				b.Fatal(err)
			}
		})
	}
}

// BenchmarkAgentLookup is the cost of the socket lookup in the agent's
// namespace, paid by packets of enrolled pods after the first of each
// connection (from-pod) and by non-HBONE packets to enrolled pods
// (node-ingress).
func BenchmarkAgentLookup(b *testing.B) {
	objs := loadNode(b)
	node, _, withNetns := agentNamespaces(b)
	if err := objs.Redirects.Update(bpf.AgentKey, withNetns); err != nil {
		b.Fatal(err)
	}
	for _, c := range []struct {
		name string
		prog *ebpf.Program
		d    decision
	}{
		{"from-pod-redirect-agent-connection", objs.FromPod, decision{"", packet{tcpFlags: flagACK, src: podA, dst: remote, sport: 41000, dport: 9443}.frame(), podAIf, actRedirect}},
		{"from-pod-pass-own-connection", objs.FromPod, decision{"", packet{tcpFlags: flagACK, src: podA, dst: remote, sport: 41001, dport: 9443}.frame(), podAIf, actNext}},
		{"node-ingress-redirect-reply", objs.NodeIngress, decision{"", packet{tcpFlags: flagACK, src: remote, dst: podA, sport: 8080, dport: 40000}.frame(), 1, actRedirect}},
		{"node-ingress-pass-plaintext", objs.NodeIngress, decision{"", packet{tcpFlags: flagACK, src: remote, dst: podA, sport: 8080, dport: 40001}.frame(), 1, actNext}},
	} {
		b.Run(c.name, func(b *testing.B) {
			var got uint32
			err := node.Do(func() (err error) {
				if got, _, err = runErr(c.prog, c.d.frame, c.d.ifindex); err != nil || got != c.d.want {
					return err
				}
				b.ResetTimer()
				_, err = c.prog.Run(&ebpf.RunOptions{
					Data: c.d.frame, Context: skbContext{IngressIfindex: c.d.ifindex},
					Repeat: uint32(b.N), Reset: b.ResetTimer,
				})
				return err
			})
			if err != nil {
				b.Fatal(err)
			}
			if got != c.d.want {
				b.Fatalf("verdict %d, want %d", int32(got), int32(c.d.want))
			}
		})
	}
}

// BenchmarkFloor measures, with the same harness, what any program on this
// path costs: an empty program (BPF_PROG_TEST_RUN's own cost per packet),
// one lookup in a hash map shaped like the redirect map (16-byte key, hit),
// and the MAC rewrite through bpf_skb_store_bytes. The redirect path needs
// three lookups (the source, the destination, the agent) and the rewrite.
//
// The lru- cases are what a SYN adds in a map shaped like proxied_map: a
// retransmitted SYN's lookup (hit), a new connection's insert (a new key
// each packet: the map fills after 65,536 packets, then each insert
// evicts), and the replace every SYN did before it looked first. Each
// draws a random number, used as the key only by the insert.
func BenchmarkFloor(b *testing.B) {
	netnstest.RequirePrivileged(b)
	m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Hash, KeySize: 16, ValueSize: 20, MaxEntries: 16384})
	if err != nil {
		b.Fatal(err)
	}
	defer m.Close()
	if err := m.Put(make([]byte, 16), make([]byte, 20)); err != nil {
		b.Fatal(err)
	}
	const connKeySize = 36
	lru, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.LRUHash, KeySize: connKeySize, ValueSize: 1, MaxEntries: 65536})
	if err != nil {
		b.Fatal(err)
	}
	defer lru.Close()
	if err := lru.Put(make([]byte, connKeySize), []byte{1}); err != nil {
		b.Fatal(err)
	}
	// A zero key at fp-40 (36 bytes), the value 1 at fp-48, a random
	// number in the key's first word when fresh, then the map operation.
	lruOp := func(fresh bool, op asm.Instructions) asm.Instructions {
		insns := asm.Instructions{asm.Mov.Imm(asm.R7, 0)}
		for off := int16(-40); off < 0; off += 8 {
			insns = append(insns, asm.StoreMem(asm.RFP, off, asm.R7, asm.DWord))
		}
		insns = append(insns,
			asm.StoreImm(asm.RFP, -48, 1, asm.Byte),
			asm.FnGetPrandomU32.Call(),
		)
		if fresh {
			insns = append(insns, asm.StoreMem(asm.RFP, -40, asm.R0, asm.Word))
		}
		insns = append(insns,
			asm.LoadMapPtr(asm.R1, lru.FD()),
			asm.Mov.Reg(asm.R2, asm.RFP),
			asm.Add.Imm(asm.R2, -40),
			asm.Mov.Reg(asm.R3, asm.RFP),
			asm.Add.Imm(asm.R3, -48),
			asm.Mov.Imm(asm.R4, 0),
		)
		return append(insns, op...)
	}
	lookups := func(n int) asm.Instructions {
		var insns asm.Instructions
		insns = append(insns, asm.Mov.Reg(asm.R6, asm.R1))
		// A zero key on the stack.
		insns = append(insns,
			asm.Mov.Imm(asm.R7, 0),
			asm.StoreMem(asm.RFP, -16, asm.R7, asm.DWord),
			asm.StoreMem(asm.RFP, -8, asm.R7, asm.DWord),
			asm.StoreMem(asm.RFP, -24, asm.R7, asm.DWord),
		)
		for range n {
			insns = append(insns,
				asm.LoadMapPtr(asm.R1, m.FD()),
				asm.Mov.Reg(asm.R2, asm.RFP),
				asm.Add.Imm(asm.R2, -16),
				asm.FnMapLookupElem.Call(),
			)
		}
		return insns
	}
	ret := asm.Instructions{asm.Mov.Imm(asm.R0, -1), asm.Return()}
	storeMAC := asm.Instructions{
		asm.Mov.Reg(asm.R1, asm.R6),
		asm.Mov.Imm(asm.R2, 0),
		asm.Mov.Reg(asm.R3, asm.RFP),
		asm.Add.Imm(asm.R3, -24),
		asm.Mov.Imm(asm.R4, 6),
		asm.Mov.Imm(asm.R5, 0),
		asm.FnSkbStoreBytes.Call(),
	}
	frame := packet{src: podA, dst: remote, sport: 40000, dport: 8080}.frame()
	for _, c := range []struct {
		name  string
		insns asm.Instructions
	}{
		{"empty", ret},
		{"lookup", append(lookups(1), ret...)},
		{"lookup-x3", append(lookups(3), ret...)},
		{"store-mac", append(append(lookups(0), storeMAC...), ret...)},
		{"lru-lookup-hit", append(lruOp(false, asm.Instructions{asm.FnMapLookupElem.Call()}), ret...)},
		{"lru-insert-new", append(lruOp(true, asm.Instructions{asm.FnMapUpdateElem.Call()}), ret...)},
		{"lru-replace", append(lruOp(false, asm.Instructions{asm.FnMapUpdateElem.Call()}), ret...)},
	} {
		b.Run(c.name, func(b *testing.B) {
			prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Type: ebpf.SchedCLS, Instructions: c.insns, License: "Apache-2.0"})
			if err != nil {
				b.Fatal(err)
			}
			defer prog.Close()
			b.ResetTimer()
			if _, err := prog.Run(&ebpf.RunOptions{Data: frame, Repeat: uint32(b.N), Reset: b.ResetTimer}); err != nil {
				b.Fatal(err)
			}
		})
	}
}
