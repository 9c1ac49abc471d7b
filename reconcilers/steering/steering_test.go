// SPDX-License-Identifier: Apache-2.0

package steering

import (
	"testing"

	"github.com/cilium/statedb"
)

type fakeMode string

func (m fakeMode) Name() string { return string(m) }
func (fakeMode) Steering(statedb.ReadTxn, string, Sandbox) (Steering, string) {
	return Settling, ""
}
func (fakeMode) Watch(statedb.ReadTxn) []<-chan struct{} { return nil }
func (fakeMode) Tables() []statedb.TableMeta             { return nil }

func TestActive(t *testing.T) {
	both := []Mode{fakeMode(ModeL2), fakeMode(ModeInPod)}
	for _, c := range []struct {
		name string
		cfg  Config
		all  []Mode
		want string
	}{
		{"no configuration means l2", Config{}, both, ModeL2},
		{"l2", Config{RedirectMode: ModeL2}, both, ModeL2},
		{"inpod", Config{RedirectMode: ModeInPod}, both, ModeInPod},
		{"a mode the hive lacks", Config{RedirectMode: ModeInPod}, both[:1], ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			m, err := Modes{Config: c.cfg, All: c.all}.Active()
			switch {
			case c.want == "" && err == nil:
				t.Errorf("got %v, want an error", m.Name())
			case c.want != "" && (err != nil || m.Name() != c.want):
				t.Errorf("got %v, %v; want %s", m, err, c.want)
			}
		})
	}
}

func TestValidate(t *testing.T) {
	for mode, ok := range map[string]bool{"": true, ModeL2: true, ModeInPod: true, "ebpf": false} {
		if err := (Config{RedirectMode: mode}).validate(); (err == nil) != ok {
			t.Errorf("--redirect-mode=%q: %v", mode, err)
		}
	}
}

func TestAnd(t *testing.T) {
	if Steered.And(Settling) != Settling || Settling.And(NotSteered) != NotSteered || Steered.And(Steered) != Steered {
		t.Error("And does not take the worse answer")
	}
}
