// SPDX-License-Identifier: Apache-2.0

package bpf

import "errors"

var (
	// ErrNotBPFFS is returned when the pin folder is not on a bpf
	// filesystem and none could be mounted.
	ErrNotBPFFS = errors.New("not on a bpf filesystem")
	// ErrUnsafePin is returned when a pin folder or pinned object could be
	// changed by someone other than root: the map decides where traffic
	// goes and must not be open to poisoning.
	ErrUnsafePin = errors.New("not owned by root, or writable by others")
	// ErrBadMAC is returned for a MAC address that is not 6 bytes.
	ErrBadMAC = errors.New("not a 6-byte MAC address")
	// ErrUnknownHook is returned for a hook this package has no program for.
	ErrUnknownHook = errors.New("unknown hook")
	// ErrMapLayout is returned for a pinned map whose keys or values are
	// not this version's (an older or newer agent pinned it).
	ErrMapLayout = errors.New("map of another layout")
)
