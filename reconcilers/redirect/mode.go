// SPDX-License-Identifier: Apache-2.0

package redirect

import (
	"errors"

	"github.com/cilium/statedb"

	"github.com/mtlsbridge/mtlsbridge/reconcilers/steering"
)

// l2Mode answers for the l2 mode from the rows of the datapath's desired
// state and their reconcile status.
type l2Mode struct {
	datapath    Datapath
	redirects   statedb.Table[*Redirect]
	attachments statedb.Table[*Attachment]
}

var (
	_ steering.Mode     = (*l2Mode)(nil)
	_ steering.Disabler = (*l2Mode)(nil)
)

// NewL2Mode puts the l2 mode into the group of redirection modes. Hives
// that provide the datapath's tables by hand (tests) provide it too.
func NewL2Mode(dp Datapath, redirects statedb.Table[*Redirect], attachments statedb.Table[*Attachment]) steering.ModeOut {
	return steering.ModeOut{Mode: &l2Mode{datapath: dp, redirects: redirects, attachments: attachments}}
}

func (m *l2Mode) Name() string { return steering.ModeL2 }

// Disabled implements steering.Disabler.
func (m *l2Mode) Disabled() bool { return errors.Is(m.datapath.Err(), ErrDisabled) }

// Steering implements steering.Mode with SteeringOf.
func (m *l2Mode) Steering(txn statedb.ReadTxn, pod string, sandbox steering.Sandbox) (steering.Steering, string) {
	if m.Disabled() {
		return NotSteered, ErrDisabled.Error()
	}
	// The datapath follows addresses and interfaces, whatever the
	// namespace: sandbox.Netns is not looked at.
	if s := SteeringOf(txn, m.redirects, m.attachments, pod, sandbox.IPs); s != Steered {
		return s, "the redirects and attachments of the reported addresses are not all done"
	}
	return Steered, ""
}

func (m *l2Mode) Watch(txn statedb.ReadTxn) []<-chan struct{} {
	_, r := m.redirects.AllWatch(txn)
	_, a := m.attachments.AllWatch(txn)
	return []<-chan struct{}{r, a}
}

func (m *l2Mode) Tables() []statedb.TableMeta {
	return []statedb.TableMeta{m.redirects, m.attachments}
}

// inactive: another mode steers the pods. The datapath then contributes
// nothing: no BPF object is loaded, no interface is watched, the tables
// stay empty (and initialized), no reconciler runs.
func inactive(mode steering.Config) bool { return mode.Mode() != steering.ModeL2 }
