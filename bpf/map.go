// SPDX-License-Identifier: Apache-2.0

package bpf

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"

	"github.com/cilium/ebpf"
)

// Kind says what a redirect map entry is.
type Kind uint32

const (
	// KindLocal marks an address on this node that is not enrolled (another
	// pod, the node itself): traffic to it is same-node and never steered.
	KindLocal = Kind(redirectRedirectKindREDIRECT_KIND_LOCAL)
	// KindEnrolled marks a local enrolled pod.
	KindEnrolled = Kind(redirectRedirectKindREDIRECT_KIND_ENROLLED)
	// KindAgent is the node's mTLS agent, under AgentKey.
	KindAgent = Kind(redirectRedirectKindREDIRECT_KIND_AGENT)
)

func (k Kind) String() string {
	switch k {
	case KindLocal:
		return "local"
	case KindEnrolled:
		return "enrolled"
	case KindAgent:
		return "agent"
	}
	return "kind(" + strconv.Itoa(int(k)) + ")"
}

// AgentKey is the well-known key of the agent's entry: the unspecified IPv6
// address, which no pod has.
var AgentKey = netip.IPv6Unspecified()

// NoNetns is Entry.NetnsID when the agent's network namespace has no id.
const NoNetns = -1

// Entry is the value of one redirect map entry.
type Entry struct {
	Kind Kind
	// Ifindex is the host-side interface in the node's network namespace:
	// the pod's own for KindEnrolled (only packets from it are steered), the
	// agent's for KindAgent (where steered packets go). 0 for KindLocal.
	Ifindex uint32
	// MAC is the address of the interface inside the pod (agent): steered
	// frames are rewritten to it.
	MAC net.HardwareAddr
	// NetnsID is, for KindAgent, the id of the agent's network namespace as
	// the node sees it; the node-ingress program looks for the agent's
	// connections there. NoNetns otherwise.
	NetnsID int32
}

func (e Entry) String() string {
	mac := "-"
	if e.MAC != nil {
		mac = e.MAC.String()
	}
	return fmt.Sprintf("%s ifindex=%d mac=%s netns=%d", e.Kind, e.Ifindex, mac, e.NetnsID)
}

// Equal reports whether two entries hold the same values.
func (e Entry) Equal(o Entry) bool {
	return e.Kind == o.Kind && e.Ifindex == o.Ifindex && e.NetnsID == o.NetnsID && e.MAC.String() == o.MAC.String()
}

// RedirectMap is a typed view of the pinned redirect map. Keys are
// addresses; IPv4 addresses are stored IPv4-mapped.
type RedirectMap struct {
	m *ebpf.Map
}

// NewRedirectMap wraps an already open redirect map, e.g. one loaded with
// ebpf.LoadPinnedMap by a watcher.
func NewRedirectMap(m *ebpf.Map) *RedirectMap { return &RedirectMap{m: m} }

// Map is the underlying map.
func (r *RedirectMap) Map() *ebpf.Map { return r.m }

func key(addr netip.Addr) redirectRedirectKey {
	return redirectRedirectKey{Addr: addr.As16()}
}

func value(e Entry) (redirectRedirectValue, error) {
	v := redirectRedirectValue{Ifindex: e.Ifindex, NetnsId: e.NetnsID, Kind: redirectRedirectKind(e.Kind)}
	if e.MAC != nil && len(e.MAC) != len(v.Mac) {
		return v, fmt.Errorf("MAC %s: %w", e.MAC, ErrBadMAC)
	}
	copy(v.Mac[:], e.MAC)
	return v, nil
}

// entry converts a map value; an all-zero MAC (local entries) is no MAC.
func entry(v redirectRedirectValue) Entry {
	e := Entry{Kind: Kind(v.Kind), Ifindex: v.Ifindex, NetnsID: v.NetnsId}
	if v.Mac != [6]byte{} {
		e.MAC = net.HardwareAddr(v.Mac[:])
	}
	return e
}

// Update writes the entry of addr.
func (r *RedirectMap) Update(addr netip.Addr, e Entry) error {
	v, err := value(e)
	if err != nil {
		return err
	}
	k := key(addr)
	return r.m.Update(&k, &v, ebpf.UpdateAny)
}

// Delete removes the entry of addr; a missing entry is not an error.
func (r *RedirectMap) Delete(addr netip.Addr) error {
	k := key(addr)
	if err := r.m.Delete(&k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return err
	}
	return nil
}

// Lookup returns the entry of addr.
func (r *RedirectMap) Lookup(addr netip.Addr) (Entry, bool, error) {
	var v redirectRedirectValue
	k := key(addr)
	if err := r.m.Lookup(&k, &v); err != nil {
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return Entry{}, false, nil
		}
		return Entry{}, false, err
	}
	return entry(v), true, nil
}

// Dump returns every entry. Addresses come back unmapped (IPv4 as IPv4).
func (r *RedirectMap) Dump() (map[netip.Addr]Entry, error) {
	out := map[netip.Addr]Entry{}
	var (
		k redirectRedirectKey
		v redirectRedirectValue
	)
	it := r.m.Iterate()
	for it.Next(&k, &v) {
		out[netip.AddrFrom16(k.Addr).Unmap()] = entry(v)
	}
	return out, it.Err()
}

// Conn is a connection of proxied_map, as its pod sends it: Src is the
// pod's end.
type Conn struct{ Src, Dst netip.AddrPort }

// ProxiedConns reads the connections an agent held (proxied_map, opened
// with ebpf.LoadPinnedMap and checked with CheckMaps). Addresses come back
// unmapped.
func ProxiedConns(m *ebpf.Map) ([]Conn, error) {
	var (
		k     redirectConnKey
		v     uint8
		conns []Conn
	)
	port := func(be uint16) uint16 { // stored as the packet has it
		var b [2]byte
		binary.NativeEndian.PutUint16(b[:], be)
		return binary.BigEndian.Uint16(b[:])
	}
	it := m.Iterate()
	for it.Next(&k, &v) {
		conns = append(conns, Conn{
			Src: netip.AddrPortFrom(netip.AddrFrom16(k.Src.Addr).Unmap(), port(k.Sport)),
			Dst: netip.AddrPortFrom(netip.AddrFrom16(k.Dst.Addr).Unmap(), port(k.Dport)),
		})
	}
	return conns, it.Err()
}

// CheckMaps tells whether the redirect map and proxied_map have this
// version's layout (maps an older or newer agent pinned may not).
//
// Possible errors: ErrMapLayout.
func CheckMaps(redirects, proxied *ebpf.Map) error {
	return errors.Join(checkLayout(redirects, redirectRedirectKey{}, redirectRedirectValue{}),
		checkLayout(proxied, redirectConnKey{}, uint8(0)))
}

func checkLayout(m *ebpf.Map, key, value any) error {
	if m.KeySize() != uint32(binary.Size(key)) || m.ValueSize() != uint32(binary.Size(value)) {
		return fmt.Errorf("%w: key %d and value %d bytes, want %d and %d", ErrMapLayout,
			m.KeySize(), m.ValueSize(), binary.Size(key), binary.Size(value))
	}
	return nil
}
