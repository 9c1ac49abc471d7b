// SPDX-License-Identifier: Apache-2.0

package bypass

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/mtlsbridge/mtlsbridge/bpf"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/redirect"
)

// fakeKernel is a Kernel of maps; the real one is tested in network
// namespaces (kernel_test.go).
type fakeKernel struct {
	entries map[netip.Addr]bpf.Entry
	mapErr  error
	links   map[string]bpf.LinkInfo
	ifaces  map[int]bool // ifindex: up
}

func (k *fakeKernel) Entries() (map[netip.Addr]bpf.Entry, error) { return k.entries, k.mapErr }

func (k *fakeKernel) Link(device string) (bpf.LinkInfo, error) {
	li, ok := k.links[device]
	if !ok {
		return li, fmt.Errorf("pin %s: %w", device, os.ErrNotExist)
	}
	return li, nil
}

func (k *fakeKernel) Interface(ifindex int) (string, bool, error) {
	up, ok := k.ifaces[ifindex]
	if !ok {
		return "", false, os.ErrNotExist
	}
	return fmt.Sprintf("if%d", ifindex), up, nil
}

type fakeAcks map[string]bool

func (a fakeAcks) HBONE(uid string) bool { return a[uid] }

var (
	ipA = netip.MustParseAddr("10.0.0.1")
	ipB = netip.MustParseAddr("10.0.0.2")
)

// good is a node where pod a (ifindex 4) and b (5) are redirected to the
// agent (ifindex 3), and both acknowledged.
func good() input {
	return input{
		Now: time.Unix(0, 0),
		Targets: []target{
			{Pod: "ns/b", UID: "b", IPs: []netip.Addr{ipB}},
			{Pod: "ns/a", UID: "a", IPs: []netip.Addr{ipA}},
		},
		Scan: redirect.Scan{Pods: map[netip.Addr]redirect.PodInterface{
			ipA: {Name: "lxca", Index: 4}, ipB: {Name: "lxcb", Index: 5},
		}},
		Kernel: &fakeKernel{
			entries: map[netip.Addr]bpf.Entry{
				ipA:          {Kind: bpf.KindEnrolled, Ifindex: 4},
				ipB:          {Kind: bpf.KindEnrolled, Ifindex: 5},
				bpf.AgentKey: {Kind: bpf.KindAgent, Ifindex: 3},
			},
			links: map[string]bpf.LinkInfo{
				"lxca": {Ifindex: 4, First: true}, "lxcb": {Ifindex: 5, First: true},
			},
			ifaces: map[int]bool{3: true},
		},
		Acks: fakeAcks{"a": true, "b": true}.HBONE,
	}
}

func gapsOf(rows []*Bypass, pod string) []string {
	for _, r := range rows {
		if r.Pod == pod {
			if r.Bypassing != (len(r.Gaps) > 0) {
				panic("BUG: Bypassing disagrees with Gaps")
			}
			return r.Gaps
		}
	}
	return []string{"no row"}
}

func TestCheck(t *testing.T) {
	tests := []struct {
		name   string
		change func(in *input)
		wantA  []string // substrings, one per gap, in order
		cleanB bool
	}{
		{"all well", func(*input) {}, nil, true},
		{"datapath disabled", func(in *input) { in.Disabled = redirect.ErrDisabled }, []string{GapDisabled}, false},
		{"map unreadable", func(in *input) { in.Kernel.(*fakeKernel).mapErr = errors.New("no pin") },
			[]string{"redirect map unreadable: no pin"}, false},
		{"no interface, partial scan", func(in *input) {
			delete(in.Scan.Pods, ipA)
			in.ScanErr = errors.New("netns 7 unreadable")
		}, []string{"10.0.0.1: " + GapNoInterface + " (partial scan: netns 7 unreadable)"}, true},
		{"entry missing", func(in *input) { delete(in.Kernel.(*fakeKernel).entries, ipA) }, []string{GapEntryMissing}, true},
		{"entry of kind local", func(in *input) { in.Kernel.(*fakeKernel).entries[ipA] = bpf.Entry{Kind: bpf.KindLocal} },
			[]string{GapEntryKind + " (local)"}, true},
		{"entry at b's interface", func(in *input) { in.Kernel.(*fakeKernel).entries[ipA] = bpf.Entry{Kind: bpf.KindEnrolled, Ifindex: 5} },
			[]string{GapWrongInterface + ": ifindex 5, the pod's is lxca (4)"}, true},
		{"not attached", func(in *input) { delete(in.Kernel.(*fakeKernel).links, "lxca") }, []string{"lxca: " + GapNotAttached}, true},
		{"link of a gone device", func(in *input) { in.Kernel.(*fakeKernel).links["lxca"] = bpf.LinkInfo{} },
			[]string{GapNotAttached + " (link detached)"}, true},
		{"link on another interface", func(in *input) { in.Kernel.(*fakeKernel).links["lxca"] = bpf.LinkInfo{Ifindex: 9, First: true} },
			[]string{GapLinkElsewhere + ": ifindex 9"}, true},
		{"not first", func(in *input) { in.Kernel.(*fakeKernel).links["lxca"] = bpf.LinkInfo{Ifindex: 4} }, []string{GapNotFirst}, true},
		{"agent entry missing", func(in *input) { delete(in.Kernel.(*fakeKernel).entries, bpf.AgentKey) }, []string{GapAgentMissing}, false},
		{"agent interface gone", func(in *input) { delete(in.Kernel.(*fakeKernel).ifaces, 3) }, []string{GapAgentGone + ": ifindex 3"}, false},
		{"agent interface down", func(in *input) { in.Kernel.(*fakeKernel).ifaces[3] = false }, []string{GapAgentDown + ": if3"}, false},
		{"not acknowledged", func(in *input) { in.Acks = fakeAcks{"b": true}.HBONE }, []string{GapNotAcked}, true},
		{"no xDS in the agent: nothing to acknowledge", func(in *input) { in.Acks = nil }, nil, true},
		{"several gaps at once", func(in *input) {
			delete(in.Kernel.(*fakeKernel).entries, ipA)
			delete(in.Kernel.(*fakeKernel).links, "lxca")
			in.Acks = fakeAcks{"b": true}.HBONE
		}, []string{GapEntryMissing, GapNotAttached, GapNotAcked}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			in := good()
			tt.change(&in)
			rows := check(in)
			if !slices.IsSortedFunc(rows, func(a, b *Bypass) int { return strings.Compare(a.Pod, b.Pod) }) || len(rows) != 2 {
				t.Fatalf("rows not one per pod, sorted: %v", rows)
			}
			gaps := gapsOf(rows, "ns/a")
			if len(gaps) != len(tt.wantA) {
				t.Fatalf("gaps of a: %q, want %q", gaps, tt.wantA)
			}
			for i, want := range tt.wantA {
				if !strings.Contains(gaps[i], want) {
					t.Errorf("gap %d of a: %q, want it to contain %q", i, gaps[i], want)
				}
			}
			if b := gapsOf(rows, "ns/b"); (len(b) == 0) != tt.cleanB {
				t.Errorf("gaps of b: %q, want clean=%v", b, tt.cleanB)
			}
		})
	}
}

func TestConfigValidate(t *testing.T) {
	if err := (Config{BypassCheckInterval: -time.Second}).validate(); err == nil || !strings.Contains(err.Error(), "BypassCheckInterval") {
		t.Errorf("negative interval: %v", err)
	}
	if err := defaultConfig.validate(); err != nil {
		t.Errorf("default: %v", err)
	}
}
