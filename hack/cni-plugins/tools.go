//go:build tools

// Package cniplugins records the two programs that hack/cni-plugins.sh builds
// so that go.mod and go.sum keep every module they need. Both are main
// packages, so this file is never compiled (the tools build tag is never set).
package cniplugins

import (
	_ "github.com/containernetworking/plugins/plugins/ipam/static"
	_ "github.com/containernetworking/plugins/plugins/main/ptp"
)
