// SPDX-License-Identifier: Apache-2.0

package inpod

import (
	"fmt"
	"slices"
	"strings"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/mtlsbridge/mtlsbridge/reconcilers/steering"
	"github.com/mtlsbridge/mtlsbridge/zds/nodeagent"
)

// inPodMode answers for the in-pod mode: a pod is steered once its
// redirection is written in its namespace and the newest ztunnel
// acknowledged its add.
type inPodMode struct {
	target       Target
	redirections statedb.Table[*Redirection]
	workloads    statedb.Table[*nodeagent.Workload]
	conns        statedb.Table[*nodeagent.Connection]
}

var (
	_ steering.Mode             = (*inPodMode)(nil)
	_ steering.BypassChecker    = (*inPodMode)(nil)
	_ steering.ConnectionCloser = (*inPodMode)(nil)
)

func newMode(target Target, r statedb.Table[*Redirection], w statedb.Table[*nodeagent.Workload], c statedb.Table[*nodeagent.Connection]) steering.ModeOut {
	return steering.ModeOut{Mode: &inPodMode{target: target, redirections: r, workloads: w, conns: c}}
}

func (m *inPodMode) Name() string { return steering.ModeInPod }

// Steering implements steering.Mode.
func (m *inPodMode) Steering(txn statedb.ReadTxn, pod string, sandbox steering.Sandbox) (steering.Steering, string) {
	rules, rulesDetail := m.rulesSteering(txn, pod, sandbox)
	held, heldDetail := m.zdsSteering(txn, pod, sandbox.Netns)
	var details []string
	for _, d := range []string{rulesDetail, heldDetail} {
		if d != "" {
			details = append(details, d)
		}
	}
	return rules.And(held), strings.Join(details, "; ")
}

func (m *inPodMode) rulesSteering(txn statedb.ReadTxn, pod string, sandbox steering.Sandbox) (steering.Steering, string) {
	r, _, ok := m.redirections.Get(txn, RedirectionByPod(pod))
	switch {
	case !ok:
		return steering.NotSteered, "no in-pod redirection (the pod is not enrolled here)"
	case r.Problem != "":
		return steering.NotSteered, r.Problem
	case len(sandbox.IPs) == 0:
		return steering.NotSteered, "the pod has no address"
	case sandbox.Netns != "" && r.Netns != sandbox.Netns:
		// An earlier sandbox's rows (its DEL lost, the same address).
		return steering.Settling, "the in-pod redirection is not derived for " + sandbox.Netns + " yet"
	}
	for _, ip := range sandbox.IPs {
		if !slices.Contains(r.IPs, ip) {
			return steering.Settling, "the in-pod redirection is not derived for " + ip.String() + " yet"
		}
	}
	switch r.Status.Kind {
	case reconciler.StatusKindDone:
		return steering.Steered, ""
	case reconciler.StatusKindError:
		return steering.NotSteered, "in-pod rules: " + r.Status.GetError()
	}
	return steering.Settling, "in-pod rules not written yet"
}

func (m *inPodMode) zdsSteering(txn statedb.ReadTxn, pod, netns string) (steering.Steering, string) {
	w, _, ok := m.workloads.Get(txn, nodeagent.WorkloadByPod(pod))
	if !ok {
		return steering.NotSteered, "not handed to ztunnel"
	}
	if w.Problem != "" {
		return steering.NotSteered, "zds: " + w.Problem
	}
	if netns != "" && w.Netns != netns {
		return steering.Settling, "zds: " + netns + " not handed to ztunnel yet"
	}
	newest, connected := nodeagent.Newest(txn, m.conns)
	switch w.State {
	case nodeagent.StateAcked:
		if connected && newest.ID == w.Conn {
			return steering.Steered, ""
		}
		return steering.Settling, "zds: waiting for the newest ztunnel to acknowledge the pod"
	case nodeagent.StatePending:
		if !connected {
			return steering.Settling, "zds: no ztunnel connected"
		}
		return steering.Settling, "zds: add not acknowledged yet"
	case nodeagent.StateNacked, nodeagent.StateFailed, nodeagent.StateKept:
		// Retried. During a rolling update an older ztunnel, still
		// connected, may serve the pod while the newest refuses it:
		// taking the pod's HBONE away then would have peers send it plain
		// TCP, which that one accepts. What is published stays while there
		// is one; the bypass check shows the refusal.
		if connected && m.conns.NumObjects(txn) > 1 {
			return steering.Settling, fmt.Sprintf("zds: %s, retried (an older ztunnel is connected): %s", w.State, w.Error)
		}
	}
	return steering.NotSteered, fmt.Sprintf("zds: %s: %s", w.State, w.Error)
}

func (m *inPodMode) Watch(txn statedb.ReadTxn) []<-chan struct{} {
	_, r := m.redirections.AllWatch(txn)
	_, w := m.workloads.AllWatch(txn)
	_, c := m.conns.AllWatch(txn)
	return []<-chan struct{}{r, w, c}
}

func (m *inPodMode) Tables() []statedb.TableMeta {
	return []statedb.TableMeta{m.redirections, m.workloads}
}

// Gap reasons of the in-pod bypass check (GapTable* and the others of
// rules.go come from the pod's namespace).
const (
	GapNoRedirection = "no in-pod redirection"
	GapNetns         = "network namespace"
	GapNoZtunnel     = "zds: no ztunnel connected"
	GapNotHeld       = "zds: the pod is not held by ztunnel"
)

// CheckBypass implements steering.BypassChecker: each pod's namespace is
// read now (the rules, the policy route), and ztunnel's acknowledgement
// of the pod on the newest connection is required.
func (m *inPodMode) CheckBypass(txn statedb.ReadTxn, targets []steering.Target) map[string][]string {
	out := map[string][]string{}
	newest, connected := nodeagent.Newest(txn, m.conns)
	for _, t := range targets {
		var gaps []string
		r, _, ok := m.redirections.Get(txn, RedirectionByPod(t.Pod))
		switch {
		case !ok:
			gaps = append(gaps, GapNoRedirection)
		case r.Problem != "":
			gaps = append(gaps, GapNoRedirection+": "+r.Problem)
		default:
			ips := t.IPs
			if len(ips) == 0 {
				ips = r.IPs
			}
			found, err := m.target.Check(r.Netns, ips)
			if err != nil {
				gaps = append(gaps, fmt.Sprintf("%s %s: %v", GapNetns, r.Netns, err))
			}
			gaps = append(gaps, found...)
		}
		w, _, ok := m.workloads.Get(txn, nodeagent.WorkloadByPod(t.Pod))
		switch {
		case !connected:
			gaps = append(gaps, GapNoZtunnel)
		case !ok:
			gaps = append(gaps, GapNotHeld)
		case w.State != nodeagent.StateAcked || w.Conn != newest.ID:
			reason := w.State
			if e := w.Error + w.Problem; e != "" {
				reason += ": " + e
			}
			gaps = append(gaps, fmt.Sprintf("%s (%s)", GapNotHeld, reason))
		}
		if len(gaps) > 0 {
			out[t.Pod] = gaps
		}
	}
	return out
}

// CloseConnections implements steering.ConnectionCloser, in the namespace
// the pod's redirection names (checked to hold its addresses).
func (m *inPodMode) CloseConnections(txn statedb.ReadTxn, pod string, conns []steering.Conn) (int, error) {
	r, _, ok := m.redirections.Get(txn, RedirectionByPod(pod))
	if !ok || r.Netns == "" {
		return 0, fmt.Errorf("%s: %w", pod, ErrNoNetns)
	}
	return m.target.CloseConnections(r.Netns, r.IPs, conns)
}
