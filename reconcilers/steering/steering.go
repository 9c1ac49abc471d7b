// SPDX-License-Identifier: Apache-2.0

package steering

import (
	"errors"
	"fmt"
	"net/netip"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
)

// Steering says whether a mode steers a pod's TCP to the mTLS agent, by
// the state of the rows that do it.
type Steering int

const (
	// Steered: everything the mode needs for the pod is in place.
	Steered Steering = iota
	// Settling: some of it is still being written or acknowledged; the
	// outcome is not known yet.
	Settling
	// NotSteered: something failed or is missing (the pod is not
	// enrolled, or its redirection cannot be put in place).
	NotSteered
)

// And combines two answers: the worse one.
func (s Steering) And(o Steering) Steering { return max(s, o) }

func (s Steering) String() string {
	switch s {
	case Steered:
		return "steered"
	case Settling:
		return "settling"
	}
	return "not-steered"
}

// Mode is one way of steering pods, as the askers see it. Answers read
// tables only, so that they are consistent within a transaction and can
// be waited for.
type Mode interface {
	// Name is the mode's --redirect-mode value.
	Name() string
	// Steering tells whether the mode steers the pod ("namespace/name")
	// in sandbox. Detail says why when the answer is not Steered.
	Steering(txn statedb.ReadTxn, pod string, sandbox Sandbox) (state Steering, detail string)
	// Watch returns channels that close when an answer may have changed.
	Watch(txn statedb.ReadTxn) []<-chan struct{}
	// Tables are the tables the answers come from: answers mean something
	// only once they are all initialized.
	Tables() []statedb.TableMeta
}

// Sandbox is what an answer is about: the sandbox being added, for the
// CNI route; the pod as the tables see it otherwise.
type Sandbox struct {
	// IPs are the pod's addresses (the sandbox's, for the CNI route).
	IPs []netip.Addr
	// Netns is the sandbox's network namespace (CNI route), "" otherwise:
	// a mode that writes into the namespace answers for that one only.
	Netns string
}

// Target is an enrolled pod of this node, for a bypass check.
type Target struct {
	// Pod is "namespace/name", UID its Kubernetes UID.
	Pod, UID string
	// IPs are its addresses as the node knows them best.
	IPs []netip.Addr
}

// BypassChecker is implemented by modes that check the kernel themselves
// (package bypass checks the l2 datapath).
type BypassChecker interface {
	// CheckBypass reads the real state now, not only the tables, and
	// returns the gaps of each target by pod ("namespace/name"): each a
	// reason some of the pod's TCP may go around the mTLS agent. Pods
	// without a gap may be absent. Every gap keeps the agent not ready
	// (the xDS acknowledgement, which package bypass adds, aside).
	CheckBypass(txn statedb.ReadTxn, targets []Target) map[string][]string
}

// Disabler is implemented by a mode that can be switched off (the l2
// mode with --enable-redirect=false): it then steers nothing, and will
// not until the agent restarts.
type Disabler interface {
	Disabled() bool
}

// ConnectionCloser is implemented by a mode that can close a pod's TCP
// connections itself (in-pod: in the pod's namespace). Taking a pod over
// from the l2 mode, the agent asks it to close those the l2 mTLS agent
// held: their ends in the pod may live on (a pooled connection whose
// peer, that agent, is gone), and their next segment would leave in
// clear once the l2 datapath no longer drops it.
type ConnectionCloser interface {
	// CloseConnections aborts the pod's sockets of conns; one that is not
	// there is no error. It returns how many it aborted.
	//
	// Possible errors: one wrapping ErrCannotClose.
	CloseConnections(txn statedb.ReadTxn, pod string, conns []Conn) (int, error)
}

// ErrCannotClose: the kernel cannot close a socket from outside its
// process (SOCK_DESTROY needs CONFIG_INET_DIAG_DESTROY).
var ErrCannotClose = errors.New("the kernel cannot close sockets: CONFIG_INET_DIAG_DESTROY is off")

// Conn is a TCP connection as the pod sees it.
type Conn struct{ Local, Remote netip.AddrPort }

// ModeOut puts a mode into the group of modes.
type ModeOut struct {
	cell.Out

	Mode Mode `group:"redirect-modes"`
}

// Modes are the modes of the hive and the configuration that picks one.
// Embed it in a constructor's parameters.
type Modes struct {
	cell.In

	// Config is optional: hives without Cell (the datapath's tests) run
	// the l2 mode.
	Config Config `optional:"true"`
	All    []Mode `group:"redirect-modes"`
}

// Active returns the mode --redirect-mode names.
//
// Possible errors: the hive has no such mode (a test hive without it).
func (m Modes) Active() (Mode, error) {
	for _, mode := range m.All {
		if mode != nil && mode.Name() == m.Config.Mode() {
			return mode, nil
		}
	}
	return nil, fmt.Errorf("redirect mode %q is not in this agent", m.Config.Mode())
}
