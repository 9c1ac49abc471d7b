// SPDX-License-Identifier: Apache-2.0

package bypass

import (
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/mtlsbridge/mtlsbridge/bpf"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/redirect"
)

// Kernel is what the check reads from the kernel, fresh at every check:
// never the reconcilers' tables, which say what was asked for and when it
// was last written, not what is there now.
type Kernel interface {
	// Entries reads the redirect map pinned under --bpf-root.
	Entries() (map[netip.Addr]bpf.Entry, error)
	// Link reads the from-pod link pinned for a device (First: whether its
	// program is the first TCX ingress program of the link's interface).
	// Possible errors: one wrapping os.ErrNotExist when nothing is pinned.
	Link(device string) (bpf.LinkInfo, error)
	// Interface returns the name of an interface of the node and whether
	// it is up (administratively and operationally).
	// Possible errors: one wrapping os.ErrNotExist when there is none.
	Interface(ifindex int) (name string, up bool, err error)
}

// target is one enrolled pod of this node.
type target struct {
	Pod string
	// UID is the pod's Workload resource name.
	UID string
	IPs []netip.Addr
}

// input is everything one check looks at.
type input struct {
	Now time.Time
	// Disabled is set when the datapath is off (--enable-redirect=false):
	// every pod bypasses.
	Disabled error
	Targets  []target
	// Scan is netlink's view of the node's interfaces: which host-side
	// veth carries each pod address.
	Scan    redirect.Scan
	ScanErr error
	Kernel  Kernel
	// Acks reports whether an mTLS agent connected now holds the
	// workload uid with HBONE as its tunnel protocol; nil when the agent
	// serves no xDS.
	Acks func(uid string) bool
}

// Gap reasons that tests and scripts match on. The reasons built with
// fmt add the address or the interface in front.
const (
	GapDisabled       = "datapath disabled (--enable-redirect=false)"
	GapNoInterface    = "no interface carries the address"
	GapEntryMissing   = "redirect entry missing"
	GapEntryKind      = "redirect entry not of kind enrolled"
	GapWrongInterface = "redirect entry points at the wrong interface"
	GapNotAttached    = "from-pod program not attached"
	GapLinkElsewhere  = "from-pod link attached to another interface"
	GapNotFirst       = "from-pod program not first"
	GapAgentMissing   = "agent entry missing"
	GapAgentGone      = "agent interface not found"
	GapAgentDown      = "agent interface down"
	GapNotAcked       = "xds: Workload not acknowledged with HBONE by the mTLS agent"
)

// check decides, for every target, whether and why it bypasses the mTLS
// agent. Rows come back sorted by pod.
func check(in input) []*Bypass {
	rows := make([]*Bypass, 0, len(in.Targets))
	if in.Disabled != nil {
		for _, t := range in.Targets {
			rows = append(rows, row(in.Now, t.Pod, []string{GapDisabled}))
		}
		return sortRows(rows)
	}

	// The node-wide state, read once: the map and the agent's entry.
	entries, mapErr := in.Kernel.Entries()
	var agentGaps []string
	if mapErr != nil {
		agentGaps = append(agentGaps, "redirect map unreadable: "+mapErr.Error())
	} else if agent, ok := entries[bpf.AgentKey]; !ok || agent.Kind != bpf.KindAgent {
		agentGaps = append(agentGaps, GapAgentMissing)
	} else if name, up, err := in.Kernel.Interface(int(agent.Ifindex)); err != nil {
		agentGaps = append(agentGaps, fmt.Sprintf("%s: ifindex %d: %v", GapAgentGone, agent.Ifindex, err))
	} else if !up {
		agentGaps = append(agentGaps, fmt.Sprintf("%s: %s", GapAgentDown, name))
	}

	for _, t := range in.Targets {
		var gaps []string
		devices := map[string]int{}
		for _, ip := range t.IPs {
			pi, found := in.Scan.Pods[ip]
			if !found {
				g := fmt.Sprintf("%s: %s", ip, GapNoInterface)
				if in.ScanErr != nil {
					g += " (partial scan: " + in.ScanErr.Error() + ")"
				}
				gaps = append(gaps, g)
				continue
			}
			devices[pi.Name] = pi.Index
			if mapErr != nil {
				continue // said once, in agentGaps
			}
			e, ok := entries[ip]
			switch {
			case !ok:
				gaps = append(gaps, fmt.Sprintf("%s: %s", ip, GapEntryMissing))
			case e.Kind != bpf.KindEnrolled:
				gaps = append(gaps, fmt.Sprintf("%s: %s (%s)", ip, GapEntryKind, e.Kind))
			case int(e.Ifindex) != pi.Index:
				gaps = append(gaps, fmt.Sprintf("%s: %s: ifindex %d, the pod's is %s (%d)", ip, GapWrongInterface, e.Ifindex, pi.Name, pi.Index))
			}
		}
		for _, dev := range slices.Sorted(maps.Keys(devices)) {
			gaps = append(gaps, linkGaps(in.Kernel, dev, devices[dev])...)
		}
		gaps = append(gaps, agentGaps...)
		if in.Acks != nil && !in.Acks(t.UID) {
			gaps = append(gaps, GapNotAcked)
		}
		rows = append(rows, row(in.Now, t.Pod, gaps))
	}
	return sortRows(rows)
}

// linkGaps checks that our from-pod program is attached, first, to the
// pod's interface.
func linkGaps(k Kernel, device string, ifindex int) []string {
	li, err := k.Link(device)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return []string{fmt.Sprintf("%s: %s", device, GapNotAttached)}
	case err != nil:
		return []string{fmt.Sprintf("%s: %s: %v", device, GapNotAttached, err)}
	case li.Ifindex == 0:
		return []string{fmt.Sprintf("%s: %s (link detached)", device, GapNotAttached)}
	case li.Ifindex != ifindex:
		return []string{fmt.Sprintf("%s: %s: ifindex %d, the pod's is %d", device, GapLinkElsewhere, li.Ifindex, ifindex)}
	case !li.First:
		return []string{fmt.Sprintf("%s: %s", device, GapNotFirst)}
	}
	return nil
}

func row(now time.Time, pod string, gaps []string) *Bypass {
	return &Bypass{Pod: pod, Bypassing: len(gaps) > 0, Gaps: gaps, CheckedAt: now}
}

func sortRows(rows []*Bypass) []*Bypass {
	slices.SortFunc(rows, func(a, b *Bypass) int { return strings.Compare(a.Pod, b.Pod) })
	return rows
}
