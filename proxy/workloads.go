// SPDX-License-Identifier: Apache-2.0

package proxy

import (
	"fmt"
	"net/netip"
	"slices"
	"sync"

	"istio.io/istio/pkg/workloadapi"
	"istio.io/istio/pkg/workloadapi/security"

	"github.com/mtlsbridge/mtlsbridge/spiffe"
)

// Workload is what the proxy uses of an istio.workload.Workload: enough to
// pick a path for a connection, the identities on both ends and the
// policies that apply.
type Workload struct {
	UID       string       `json:"uid"`
	Name      string       `json:"name"`
	Namespace string       `json:"namespace"`
	Node      string       `json:"node"`
	Addresses []netip.Addr `json:"addresses"`
	// HBONE: the workload's node captures its traffic, so peers send to it
	// through HBONE on port 15008; otherwise (NONE) plain TCP.
	HBONE bool `json:"hbone"`
	// Identity is the SPIFFE ID its certificate carries:
	// spiffe://TD/ns/NAMESPACE/sa/SERVICEACCOUNT.
	Identity string `json:"identity"`
	// Policies names the WORKLOAD_SELECTOR Authorizations ("ns/name") that
	// select this workload.
	Policies []string `json:"policies,omitempty"`
}

// workloadFrom converts a Workload resource, checking what the proxy relies
// on: a uid, addresses of 4 or 16 bytes, an identity that parses.
func workloadFrom(w *workloadapi.Workload) (*Workload, error) {
	if w.GetUid() == "" {
		return nil, fmt.Errorf("%w: no uid", ErrBadWorkload)
	}
	td := w.GetTrustDomain()
	if td == "" {
		td = spiffe.DefaultTrustDomain
	}
	sa := w.GetServiceAccount()
	if sa == "" {
		sa = "default"
	}
	id := spiffe.WorkloadID(td, w.GetNamespace(), sa)
	if _, err := spiffe.ParseID(id); err != nil {
		return nil, fmt.Errorf("%w: %s: identity: %v", ErrBadWorkload, w.GetUid(), err)
	}
	out := &Workload{
		UID:       w.GetUid(),
		Name:      w.GetName(),
		Namespace: w.GetNamespace(),
		Node:      w.GetNode(),
		HBONE:     w.GetTunnelProtocol() == workloadapi.TunnelProtocol_HBONE,
		Identity:  id,
		Policies:  slices.Clone(w.GetAuthorizationPolicies()),
	}
	for _, b := range w.GetAddresses() {
		ip, ok := netip.AddrFromSlice(b)
		if !ok {
			return nil, fmt.Errorf("%w: %s: address of %d bytes", ErrBadWorkload, w.GetUid(), len(b))
		}
		out.Addresses = append(out.Addresses, ip.Unmap())
	}
	return out, nil
}

// HasAddress tells whether ip is one of the workload's addresses.
func (w *Workload) HasAddress(ip netip.Addr) bool {
	return slices.Contains(w.Addresses, ip.Unmap())
}

// State is what xDS told the proxy: workloads (indexed by resource name,
// uid and address) and Authorization policies. Readers take snapshots of
// single entries; the xDS client is the only writer.
type State struct {
	localNode string

	mu        sync.RWMutex
	workloads map[string]*Workload // by resource name
	byUID     map[string]*Workload
	// byIP holds every workload of an address, the latest put last: a
	// pod's address is taken by its successor while it terminates, and
	// either may be removed or updated first.
	byIP     map[netip.Addr][]*Workload
	policies map[string]*security.Authorization // by resource name "ns/name"
	// changed is closed and replaced at every change, so that the
	// certificate manager wakes up for new and gone local workloads.
	changed chan struct{}
	// policiesChanged is the same for what decides which policies apply:
	// the policies and this node's workloads.
	policiesChanged chan struct{}
}

// NewState returns an empty state for a proxy on localNode.
func NewState(localNode string) *State {
	return &State{
		localNode: localNode,
		workloads: map[string]*Workload{},
		byUID:     map[string]*Workload{},
		byIP:      map[netip.Addr][]*Workload{},
		policies:  map[string]*security.Authorization{},
		changed:   make(chan struct{}),

		policiesChanged: make(chan struct{}),
	}
}

// LocalNode is the node the proxy serves.
func (s *State) LocalNode() string { return s.localNode }

// Changed is closed at the next change.
func (s *State) Changed() <-chan struct{} {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.changed
}

// PoliciesChanged is closed at the next change of the policies or of a
// workload of this node.
func (s *State) PoliciesChanged() <-chan struct{} {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.policiesChanged
}

// ByIP returns the workload that has the address (of several, the latest
// put), or nil.
func (s *State) ByIP(ip netip.Addr) *Workload {
	s.mu.RLock()
	defer s.mu.RUnlock()
	holders := s.byIP[ip.Unmap()]
	if len(holders) == 0 {
		return nil
	}
	return holders[len(holders)-1]
}

// ByUID returns the workload of that uid, or nil.
func (s *State) ByUID(uid string) *Workload {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.byUID[uid]
}

// LocalByIP returns the workload of this node that has the address, or nil.
func (s *State) LocalByIP(ip netip.Addr) *Workload {
	if w := s.ByIP(ip); w != nil && w.Node == s.localNode {
		return w
	}
	return nil
}

// LocalIdentities returns the identities of this node's workloads.
func (s *State) LocalIdentities() map[string]bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	ids := map[string]bool{}
	for _, w := range s.workloads {
		if w.Node == s.localNode {
			ids[w.Identity] = true
		}
	}
	return ids
}

// Workloads returns every workload, in no order.
func (s *State) Workloads() []*Workload {
	s.mu.RLock()
	defer s.mu.RUnlock()
	out := make([]*Workload, 0, len(s.workloads))
	for _, w := range s.workloads {
		out = append(out, w)
	}
	return out
}

// PolicyNames returns the names of the Authorization policies held, sorted.
func (s *State) PolicyNames() []string {
	s.mu.RLock()
	defer s.mu.RUnlock()
	names := make([]string, 0, len(s.policies))
	for name := range s.policies {
		names = append(names, name)
	}
	slices.Sort(names)
	return names
}

// Policies returns the Authorization policies that apply to a workload:
// GLOBAL ones, NAMESPACE ones of its namespace, and the WORKLOAD_SELECTOR
// ones it names.
func (s *State) Policies(w *Workload) []*security.Authorization {
	s.mu.RLock()
	defer s.mu.RUnlock()
	var out []*security.Authorization
	for _, p := range s.policies {
		switch p.GetScope() {
		case security.Scope_GLOBAL:
			out = append(out, p)
		case security.Scope_NAMESPACE:
			if p.GetNamespace() == w.Namespace {
				out = append(out, p)
			}
		}
	}
	for _, name := range w.Policies {
		if p, ok := s.policies[name]; ok && p.GetScope() == security.Scope_WORKLOAD_SELECTOR {
			out = append(out, p)
		}
	}
	return out
}

// putWorkload inserts or replaces the workload under a resource name.
func (s *State) putWorkload(name string, w *Workload) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if old := s.workloads[name]; w.Node == s.localNode || old != nil && old.Node == s.localNode {
		s.signalPoliciesLocked()
	}
	s.deleteWorkloadLocked(name)
	s.workloads[name] = w
	s.byUID[w.UID] = w
	for _, ip := range w.Addresses {
		s.byIP[ip] = append(s.byIP[ip], w)
	}
	s.signalLocked()
}

// deleteWorkload removes what the resource name held; a name it does not
// know (a Service, say) is ignored.
func (s *State) deleteWorkload(name string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if old := s.workloads[name]; old != nil && old.Node == s.localNode {
		s.signalPoliciesLocked()
	}
	if s.deleteWorkloadLocked(name) {
		s.signalLocked()
	}
}

func (s *State) deleteWorkloadLocked(name string) bool {
	old, ok := s.workloads[name]
	if !ok {
		return false
	}
	delete(s.workloads, name)
	if s.byUID[old.UID] == old {
		delete(s.byUID, old.UID)
	}
	for _, ip := range old.Addresses {
		// Other workloads holding the address keep it.
		if holders := slices.DeleteFunc(s.byIP[ip], func(w *Workload) bool { return w == old }); len(holders) > 0 {
			s.byIP[ip] = holders
		} else {
			delete(s.byIP, ip)
		}
	}
	return true
}

func (s *State) putPolicy(name string, p *security.Authorization) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.policies[name] = p
	s.signalLocked()
	s.signalPoliciesLocked()
}

func (s *State) deletePolicy(name string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.policies[name]; ok {
		delete(s.policies, name)
		s.signalLocked()
		s.signalPoliciesLocked()
	}
}

func (s *State) signalLocked() {
	close(s.changed)
	s.changed = make(chan struct{})
}

func (s *State) signalPoliciesLocked() {
	close(s.policiesChanged)
	s.policiesChanged = make(chan struct{})
}
