// SPDX-License-Identifier: Apache-2.0

// Command mtlsbridge-cni is the chained CNI plugin that keeps enrolled pods
// from starting before their mTLS redirection is in place (package
// cni/plugin). The agent installs it; "mtlsbridge-cni uninstall" removes it.
package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/mtlsbridge/mtlsbridge/cni/install"
	"github.com/mtlsbridge/mtlsbridge/cni/plugin"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "uninstall" && os.Getenv("CNI_COMMAND") == "" {
		os.Exit(uninstall(os.Args[2:]))
	}
	plugin.Main()
}

// uninstall is the explicit removal step: the agent never removes the
// plugin itself, so that pods stay blocked while it is down.
func uninstall(args []string) int {
	fs := flag.NewFlagSet("uninstall", flag.ContinueOnError)
	confDir := fs.String("cni-conf-dir", "/etc/cni/net.d", "CNI configuration folder")
	binDir := fs.String("cni-bin-dir", "/opt/cni/bin", "CNI plugin folder")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if err := install.Uninstall(*confDir, *binDir, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "mtlsbridge-cni uninstall:", err)
		return 1
	}
	return 0
}
