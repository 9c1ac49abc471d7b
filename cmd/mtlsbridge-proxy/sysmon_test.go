// SPDX-License-Identifier: Apache-2.0

package main

import (
	"slices"
	"testing"
)

func TestWithSysmonAwake(t *testing.T) {
	for _, c := range []struct {
		name    string
		environ []string
		want    []string
		again   bool
	}{
		{"no GODEBUG", []string{"A=1"}, []string{"A=1", "GODEBUG=" + sysmonAwake}, true},
		{"other settings kept", []string{"GODEBUG=http2debug=1", "A=1"},
			[]string{"A=1", "GODEBUG=http2debug=1," + sysmonAwake}, true},
		{"empty GODEBUG", []string{"GODEBUG="}, []string{"GODEBUG=" + sysmonAwake}, true},
		{"the first GODEBUG counts", []string{"GODEBUG=x=1", "GODEBUG=schedtrace=5"},
			[]string{"GODEBUG=x=1," + sysmonAwake}, true},
		{"the operator's schedtrace", []string{"GODEBUG=a=1,schedtrace=0"}, []string{"GODEBUG=a=1,schedtrace=0"}, false},
		{"a setting that only ends like it", []string{"GODEBUG=noschedtrace=1"},
			[]string{"GODEBUG=noschedtrace=1," + sysmonAwake}, true},
	} {
		got, again := withSysmonAwake(c.environ)
		if !slices.Equal(got, c.want) || again != c.again {
			t.Errorf("%s: %q %v, want %q %v", c.name, got, again, c.want, c.again)
		}
	}
}
