// SPDX-License-Identifier: Apache-2.0

package bpf

// The generated files (redirect_bpfel.go, redirect_bpfeb.go and their .o) are
// committed: building needs no clang. `make generate` runs this line.
//go:generate go tool bpf2go -tags linux -type redirect_key -type redirect_value -type redirect_kind redirect redirect.c -- -I/usr/include/x86_64-linux-gnu -O2 -g -Wall -Werror
