// SPDX-License-Identifier: Apache-2.0

// Package steeringtest has a stand-in redirection mode, for tests of what
// asks a mode (readiness, the hand-over between modes) without that
// mode's datapath, which has tests of its own.
package steeringtest

import (
	"slices"
	"sync"

	"github.com/cilium/statedb"

	"github.com/mtlsbridge/mtlsbridge/reconcilers/steering"
)

// Mode steers the pods the test names (or all of them) until it is
// disabled. Its watch channel closes at every change of an answer.
type Mode struct {
	name     string
	mu       sync.Mutex
	all      bool
	disabled bool
	steered  map[string]bool
	changed  chan struct{}
	// closed are the connections asked to be closed, by pod.
	closed map[string][]steering.Conn
	// closeErr is what closing connections answers.
	closeErr error
}

var (
	_ steering.Mode             = (*Mode)(nil)
	_ steering.Disabler         = (*Mode)(nil)
	_ steering.ConnectionCloser = (*Mode)(nil)
)

// New returns a mode of that name that steers no pod yet.
func New(name string) *Mode {
	return &Mode{name: name, steered: map[string]bool{}, changed: make(chan struct{}), closed: map[string][]steering.Conn{}}
}

// Out provides the mode to the hive's group of modes.
func (m *Mode) Out() steering.ModeOut { return steering.ModeOut{Mode: m} }

func (m *Mode) Name() string { return m.name }

func (m *Mode) Steering(_ statedb.ReadTxn, pod string, _ steering.Sandbox) (steering.Steering, string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.disabled && (m.all || m.steered[pod]) {
		return steering.Steered, ""
	}
	return steering.NotSteered, "not steered by the test's " + m.name + " mode"
}

func (m *Mode) Disabled() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.disabled
}

func (m *Mode) Watch(statedb.ReadTxn) []<-chan struct{} {
	m.mu.Lock()
	defer m.mu.Unlock()
	return []<-chan struct{}{m.changed}
}

func (m *Mode) Tables() []statedb.TableMeta { return nil }

// CloseConnections records what it is asked to close (the test's mode
// has no sockets), and fails as FailClose says.
func (m *Mode) CloseConnections(_ statedb.ReadTxn, pod string, conns []steering.Conn) (int, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.closed[pod] = append(m.closed[pod], conns...)
	if m.closeErr != nil {
		return 0, m.closeErr
	}
	return len(conns), nil
}

// FailClose makes closing connections fail with err from now on (nil:
// succeed).
func (m *Mode) FailClose(err error) { m.change(func() { m.closeErr = err }) }

// Closed returns the connections of pod the mode was asked to close.
func (m *Mode) Closed(pod string) []steering.Conn {
	m.mu.Lock()
	defer m.mu.Unlock()
	return slices.Clone(m.closed[pod])
}

// Steer makes the mode steer the pods ("namespace/name").
func (m *Mode) Steer(pods ...string) {
	m.change(func() {
		for _, pod := range pods {
			m.steered[pod] = true
		}
	})
}

// SteerAll makes the mode steer every pod.
func (m *Mode) SteerAll() { m.change(func() { m.all = true }) }

// Disable switches the mode off, as --enable-redirect=false does l2.
func (m *Mode) Disable() { m.change(func() { m.disabled = true }) }

func (m *Mode) change(f func()) {
	m.mu.Lock()
	defer m.mu.Unlock()
	f()
	close(m.changed)
	m.changed = make(chan struct{})
}
