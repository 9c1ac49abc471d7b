// SPDX-License-Identifier: Apache-2.0

// Command mtlsbridge is the node agent of Cilium mTLS via an mTLS agent
// (CFP-32759) and its command-line client.
package main

import (
	"fmt"
	"os"
)

func main() {
	if err := rootCmd().Execute(); err != nil {
		fmt.Fprintln(os.Stderr, "Error:", err)
		os.Exit(1)
	}
}
