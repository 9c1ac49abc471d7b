// SPDX-License-Identifier: Apache-2.0

package inpod

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"time"

	"github.com/google/nftables"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/mtlsbridge/mtlsbridge/nodenetns"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/steering"
	"github.com/mtlsbridge/mtlsbridge/zds"
)

// Target is where the in-pod redirection goes: the pods' network
// namespaces, through netlink. The cell provides that one; tests of the
// derivation and of ZDS provide another.
type Target interface {
	// Apply writes the redirection of r into its namespace, which must
	// hold r.IPs, and returns which namespace that was.
	Apply(r *Redirection) (NetnsID, error)
	// Identify tells which namespace path names now. A path may name
	// another namespace later: /proc/PID/ns/net once the PID is reused.
	// Possible errors: one wrapping os.ErrNotExist when it is gone.
	Identify(path string) (NetnsID, error)
	// Remove deletes the redirection from the namespace id, at path; a
	// namespace that is gone (path names another now), or that is the
	// node's, is left alone.
	Remove(path string, id NetnsID) error
	// Present tells whether anything of the redirection is in the
	// namespace id, at path; false, without an error, when the namespace
	// is gone, is the node's, or the path is no network namespace.
	Present(path string, id NetnsID) (bool, error)
	// Check reads the namespace now and returns how it differs from what
	// Apply writes for ips, and which of ztunnel's listeners are missing.
	Check(path string, ips []netip.Addr) ([]string, error)
	// Open opens the namespace to hand it to ztunnel (checked to hold ips).
	// Possible errors: one wrapping os.ErrNotExist when it is gone.
	Open(path string, ips []netip.Addr) (*os.File, error)
	// CloseConnections aborts the namespace's TCP sockets of conns
	// (checked to hold ips) and returns how many there were.
	CloseConnections(path string, ips []netip.Addr, conns []steering.Conn) (int, error)
	// CloseAll aborts every TCP connection of the namespace id, at path
	// (listeners stay), and returns how many there were; a namespace that
	// is gone has none.
	CloseAll(path string, id NetnsID) (int, error)
	// Namespaces lists the network namespaces pinned in dir, but the
	// node's, with the addresses each holds. Entries that are no network
	// namespace are passed over; those that cannot be read are errors, by
	// path (dir's own, cleaned, when it cannot be listed).
	Namespaces(dir string) ([]Namespace, map[string]error)
	// WriteProbeSNAT makes the node SNAT its own TCP connections to ips
	// (the kubelet's probes) to the probe addresses; without ips, nothing
	// of it stays on the node.
	WriteProbeSNAT(ips []netip.Addr) error
	// CheckProbeSNAT reads the node now and returns how it differs from
	// what WriteProbeSNAT(ips) writes.
	CheckProbeSNAT(ips []netip.Addr) ([]string, error)
}

// Namespace is a network namespace pinned in a folder: where, which, its
// addresses, and since when it exists (at the latest).
type Namespace struct {
	Path        string
	ID          NetnsID
	IPs         []netip.Addr
	ExistsSince time.Time
}

// NetnsID identifies a network namespace, whatever path names it: its
// device and inode. Unique among live namespaces only: the kernel reuses
// the inode numbers of namespaces gone (see RulesOps.written, the one
// place that keeps an identity beyond an operation).
type NetnsID struct{ Dev, Ino uint64 }

// netlinkTarget writes into the real namespaces: the pods', and the
// node's.
type netlinkTarget struct{ node *nodenetns.Namespace }

func newNetlinkTarget(node *nodenetns.Namespace) Target { return netlinkTarget{node} }

func (netlinkTarget) Apply(r *Redirection) (NetnsID, error) {
	var id NetnsID
	err := inPodNetns(r.Netns, r.IPs, func(h netns.NsHandle) (err error) {
		if id, err = netnsID(h); err != nil {
			return err
		}
		return applyRules(h, familiesOf(r.IPs))
	})
	return id, err
}

func (netlinkTarget) Identify(path string) (NetnsID, error) {
	id, err := statNetns(path)
	switch {
	case err == nil:
		return id, nil
	case errors.Is(err, unix.ENOTDIR), errors.Is(err, unix.ENAMETOOLONG), errors.Is(err, unix.ELOOP):
		// A path that can name nothing names no namespace either.
		return NetnsID{}, fmt.Errorf("stat %s: %v: %w", path, err, os.ErrNotExist)
	default:
		return NetnsID{}, &os.PathError{Op: "stat", Path: path, Err: err}
	}
}

func (netlinkTarget) Remove(path string, id NetnsID) error {
	err := inPodNetns(path, nil, func(h netns.NsHandle) error {
		if err := sameNetns(h, path, id); err != nil {
			return err
		}
		return removeRules(h)
	})
	if errors.Is(err, os.ErrNotExist) || errors.Is(err, ErrNodeNetns) {
		return nil
	}
	return err
}

func (netlinkTarget) Present(path string, id NetnsID) (bool, error) {
	present := false
	err := inPodNetns(path, nil, func(h netns.NsHandle) (err error) {
		if err := sameNetns(h, path, id); err != nil {
			return err
		}
		present, err = rulesPresent(h)
		return err
	})
	if errors.Is(err, os.ErrNotExist) || errors.Is(err, ErrNodeNetns) || errors.Is(err, zds.ErrNotNetns) {
		return false, nil
	}
	return present, err
}

func (netlinkTarget) Check(path string, ips []netip.Addr) ([]string, error) {
	var gaps []string
	err := inPodNetns(path, ips, func(h netns.NsHandle) error {
		rules, err := checkRules(h, familiesOf(ips))
		if err != nil {
			return err
		}
		listeners, err := checkListeners(h)
		gaps = append(rules, listeners...)
		return err
	})
	return gaps, err
}

func (netlinkTarget) Open(path string, ips []netip.Addr) (*os.File, error) {
	return openPodNetns(path, ips)
}

func (netlinkTarget) CloseConnections(path string, ips []netip.Addr, conns []steering.Conn) (closed int, err error) {
	err = inPodNetns(path, ips, func(h netns.NsHandle) error {
		closed, err = closeConnections(h, conns)
		return err
	})
	return closed, err
}

func (netlinkTarget) CloseAll(path string, id NetnsID) (closed int, err error) {
	err = inPodNetns(path, nil, func(h netns.NsHandle) error {
		if err := sameNetns(h, path, id); err != nil {
			return err
		}
		closed, err = closeAll(h)
		return err
	})
	if errors.Is(err, os.ErrNotExist) {
		return 0, nil
	}
	return closed, err
}

func (netlinkTarget) Namespaces(dir string) ([]Namespace, map[string]error) {
	dir = filepath.Clean(dir)
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, map[string]error{dir: err}
	}
	var found []Namespace
	errs := map[string]error{}
	for _, e := range entries {
		if e.IsDir() {
			continue
		}
		path := filepath.Join(dir, e.Name())
		ns := Namespace{Path: path}
		err := inPodNetns(path, nil, func(h netns.NsHandle) error {
			// The namespace's inode (nsfs) is made when something refers
			// to the namespace, and lives while something does (the pin,
			// which cannot change it): its change time is between the
			// namespace's creation and the pin.
			var err error
			if ns.ID, ns.ExistsSince, err = netnsStat(h); err != nil {
				return err
			}
			ns.IPs, err = netnsAddrs(h)
			return err
		})
		switch {
		case err == nil:
			found = append(found, ns)
		case errors.Is(err, os.ErrNotExist), errors.Is(err, zds.ErrNotNetns), errors.Is(err, ErrNodeNetns):
			// Gone meanwhile, a file of another kind, the node's own.
		default:
			errs[path] = err
		}
	}
	return found, errs
}

func (t netlinkTarget) WriteProbeSNAT(ips []netip.Addr) error {
	return t.inNodeNftables(func(conn *nftables.Conn) error { return writeProbeSNAT(conn, ips) })
}

func (t netlinkTarget) CheckProbeSNAT(ips []netip.Addr) (gaps []string, err error) {
	err = t.inNodeNftables(func(conn *nftables.Conn) (err error) {
		gaps, err = checkProbeSNAT(conn, ips)
		return err
	})
	return gaps, err
}

// inNodeNftables runs fn with an nftables connection of the node's
// namespace: its sockets are opened in the calling thread's namespace.
func (t netlinkTarget) inNodeNftables(fn func(*nftables.Conn) error) error {
	return t.node.Do(func() error {
		conn, err := nftables.New()
		if err != nil {
			return err
		}
		return fn(conn)
	})
}

// statNetns is the identity of what path names now; the error is stat's.
func statNetns(path string) (NetnsID, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return NetnsID{}, err
	}
	return NetnsID{Dev: st.Dev, Ino: st.Ino}, nil
}

// netnsID is the identity of the namespace h holds open.
func netnsID(h netns.NsHandle) (NetnsID, error) {
	id, _, err := netnsStat(h)
	return id, err
}

// netnsStat is the identity of the namespace h holds open, and the change
// time of its inode.
func netnsStat(h netns.NsHandle) (NetnsID, time.Time, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(h), &st); err != nil {
		return NetnsID{}, time.Time{}, err
	}
	return NetnsID{Dev: st.Dev, Ino: st.Ino}, time.Unix(st.Ctim.Unix()), nil
}

// sameNetns checks that the namespace opened at path is still id: if not,
// the namespace that was there is gone.
func sameNetns(h netns.NsHandle, path string, id NetnsID) error {
	opened, err := netnsID(h)
	if err != nil {
		return err
	}
	if opened != id {
		return fmt.Errorf("%s names another namespace now: %w", path, os.ErrNotExist)
	}
	return nil
}
