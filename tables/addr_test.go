// SPDX-License-Identifier: Apache-2.0

package tables

import (
	"errors"
	"net/netip"
	"testing"
)

func TestParsePodAddr(t *testing.T) {
	for in, want := range map[string]string{
		"10.0.0.1":         "10.0.0.1",
		"::ffff:10.0.0.1":  "10.0.0.1", // one address, one spelling
		"fd00::1":          "fd00::1",
		"::":               "", // the mTLS agent's key in the redirect map
		"0.0.0.0":          "",
		"::ffff:0.0.0.0":   "",
		"127.0.0.1":        "",
		"::1":              "",
		"::ffff:127.0.0.1": "",
		"224.0.0.1":        "",
		"ff02::1":          "",
		"fe80::1%eth0":     "",
		"10.0.1.999":       "",
		"":                 "",
	} {
		got, err := ParsePodAddr(in)
		switch {
		case want == "" && !errors.Is(err, ErrNotPodAddr):
			t.Errorf("ParsePodAddr(%q) = %s, %v; want ErrNotPodAddr", in, got, err)
		case want != "" && (err != nil || got != netip.MustParseAddr(want)):
			t.Errorf("ParsePodAddr(%q) = %s, %v; want %s", in, got, err, want)
		}
	}
}
