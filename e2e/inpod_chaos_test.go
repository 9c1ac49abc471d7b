// SPDX-License-Identifier: Apache-2.0

package e2e_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mtlsbridge/mtlsbridge/internal/cnitest"
	"github.com/mtlsbridge/mtlsbridge/internal/netnstest"
	"github.com/mtlsbridge/mtlsbridge/proxy"
)

// Size of TestInPodNeverLeak: pods that come and go on node-a while its
// agent and its proxy are killed with SIGKILL and restarted, bounded in
// count and time.
const (
	inPodMaxPods          = 48
	inPodMinPods          = 24
	inPodMinAgentRestarts = 6
	inPodMinProxyRestarts = 6
	inPodConcurrency      = 4
	inPodChaosLimit       = 75 * time.Second
	inPodPayload          = 4 << 10
)

// TestInPodNeverLeak: in the in-pod mode, pods start and go on node-a while
// its node agent and its mTLS agent are killed with SIGKILL and restarted,
// apart and together. An enrolled pod starts only once its redirection is
// in its namespace and the mTLS agent serves it there (its listeners are
// in the pod); its TCP to an enrolled pod of node-b crosses the underlay
// only as HBONE, never with its payload in clear, whatever was down when
// it sent; pods not enrolled are seen in clear (the capture works).
func TestInPodNeverLeak(t *testing.T) {
	b := newBedWith(t, newFolderCluster(t), bedConfig{inPod: true})
	na, nb := b.nodes[0], b.nodes[1]
	r := nb.addPod("r", "app", true, false)
	b.knows(na, nil, r, true)
	enrolledMarker, plainMarker := newMarker("enrolled"), newMarker("plain")
	b.underlay.Watch(enrolledMarker)
	b.underlay.Watch(plainMarker)

	// The pods' namespaces and sandboxes are made here, in the test's
	// goroutine; they start and go in goroutines of their own.
	var pods []*bedPod
	for i := range inPodMaxPods {
		pods = append(pods, na.newChurnPod(fmt.Sprintf("c%d", i), i%3 != 2))
	}
	var enrolledAddrs sync.Map
	for _, p := range pods {
		if p.enrolled {
			enrolledAddrs.Store(p.ip4, p.name)
			enrolledAddrs.Store(p.ip6, p.name)
		}
	}

	var (
		proxyGen                     atomic.Int64 // proxy kills so far
		started, failedAdds          atomic.Int64
		viaMTLS, refused, plainOK    atomic.Int64
		mu                           sync.Mutex
		violations                   []string
		done                         = make(chan struct{})
		agentRestarts, proxyRestarts int
		ctx, cancel                  = context.WithTimeout(context.Background(), inPodChaosLimit+2*bedTimeout)
	)
	defer cancel()
	violation := func(format string, args ...any) {
		mu.Lock()
		defer mu.Unlock()
		violations = append(violations, fmt.Sprintf(format, args...))
	}

	podsDone := make(chan struct{})
	go func() {
		defer close(podsDone)
		slots := make(chan struct{}, inPodConcurrency)
		var wg sync.WaitGroup
		defer wg.Wait()
		for _, p := range pods {
			select {
			case <-done:
				return
			case slots <- struct{}{}:
			}
			wg.Add(1)
			go func() {
				defer func() { <-slots; wg.Done() }()
				gen := proxyGen.Load()
				failures, err := b.startChurnPod(ctx, p)
				failedAdds.Add(int64(failures))
				if err != nil {
					violation("%s did not start: %v", p, err)
					return
				}
				started.Add(1)
				// At the moment ADD returned, the pod's redirection and the
				// proxy's listeners were in its namespace; a proxy killed
				// since may have taken its listeners along.
				if p.enrolled {
					if err := inPodInPlace(p); err != nil && proxyGen.Load() == gen {
						violation("%s started while not in place: %v", p, err)
					}
				}
				marker := plainMarker
				if p.enrolled {
					marker = enrolledMarker
				}
				body := requestBody(marker, inPodPayload)
				stop := time.After(time.Duration(800+rand.IntN(800)) * time.Millisecond)
			traffic:
				for i := 0; i < 100; i++ {
					select {
					case <-stop:
						break traffic
					default:
					}
					reply, err := send(p, netip.AddrPortFrom(r.addr(i%2 == 1), digestPort), body)
					switch {
					case err != nil:
						refused.Add(1)
					case reply.server != "r":
						violation("%s reached %s, not r", p, reply.server)
					case p.enrolled:
						viaMTLS.Add(1)
					default:
						plainOK.Add(1)
					}
					time.Sleep(50 * time.Millisecond)
				}
				b.stopChurnPod(p)
			}()
		}
	}()

	// Chaos: node-a's agent and proxy killed (SIGKILL) and restarted,
	// apart and sometimes together.
	deadline := time.Now().Add(inPodChaosLimit)
	for (agentRestarts < inPodMinAgentRestarts || proxyRestarts < inPodMinProxyRestarts || started.Load() < inPodMinPods) &&
		time.Now().Before(deadline) && !t.Failed() {
		time.Sleep(time.Duration(1500+rand.IntN(2000)) * time.Millisecond)
		what := rand.IntN(3) // 0 agent, 1 proxy, 2 both
		if what != 1 {
			na.killAgent()
			agentRestarts++
		}
		if what != 0 {
			proxyGen.Add(1)
			na.killProxy()
			proxyRestarts++
		}
		time.Sleep(time.Duration(200+rand.IntN(800)) * time.Millisecond)
		na.startAgent()
		na.startProxy()
	}
	close(done)
	<-podsDone
	time.Sleep(captureLag)

	var leaked []netnstest.Segment
	for _, s := range b.underlay.Segments() {
		_, fromEnrolled := enrolledAddrs.Load(s.Src.Addr())
		_, toEnrolled := enrolledAddrs.Load(s.Dst.Addr())
		hbone := s.Src.Port() == proxy.HBONEPort || s.Dst.Port() == proxy.HBONEPort
		if (fromEnrolled || toEnrolled) && !hbone {
			leaked = append(leaked, s)
		}
	}
	t.Logf("%d agent and %d proxy restarts (SIGKILL), %d pods started and deleted (%d failed ADDs retried); "+
		"enrolled pods' requests answered through mTLS %d, refused %d; plain pods' answered %d; "+
		"%d segments on the underlay, %d of an enrolled pod outside HBONE, enrolled payload seen %d times, plain payload %d times",
		agentRestarts, proxyRestarts, started.Load(), failedAdds.Load(), viaMTLS.Load(), refused.Load(), plainOK.Load(),
		len(b.underlay.Segments()), len(leaked), len(b.underlay.Seen(enrolledMarker)), len(b.underlay.Seen(plainMarker)))
	for _, v := range violations {
		t.Error(v)
	}
	for i, s := range leaked {
		if i == 10 {
			t.Errorf("... %d more", len(leaked)-10)
			break
		}
		t.Errorf("an enrolled pod's TCP outside HBONE on the underlay: %s", s)
	}
	if seen := b.underlay.Seen(enrolledMarker); len(seen) > 0 {
		t.Errorf("an enrolled pod's payload crossed the underlay in clear: %s", seen[0])
	}
	if agentRestarts < inPodMinAgentRestarts || proxyRestarts < inPodMinProxyRestarts || started.Load() < inPodMinPods {
		t.Errorf("ran %d agent and %d proxy restarts and %d pods in %s, want at least %d, %d and %d", agentRestarts, proxyRestarts,
			started.Load(), inPodChaosLimit, inPodMinAgentRestarts, inPodMinProxyRestarts, inPodMinPods)
	}
	if err := b.underlay.Err(); err != nil || b.underlay.Dropped() > 0 {
		t.Errorf("capture: %v, %d dropped", err, b.underlay.Dropped())
	}
	// Without these, no leak proves nothing.
	if len(b.underlay.Seen(plainMarker)) == 0 || viaMTLS.Load() == 0 {
		t.Errorf("no plain payload on the underlay (%d), or no enrolled request answered through mTLS (%d)",
			len(b.underlay.Seen(plainMarker)), viaMTLS.Load())
	}
}

// newChurnPod makes a pod's namespace and sandbox without starting it.
func (n *bedNode) newChurnPod(name string, enrolled bool) *bedPod {
	b := n.bed
	n.mu.Lock()
	last := n.nextAddr
	n.nextAddr++
	n.mu.Unlock()
	p := &bedPod{name: name, namespace: "app", serviceAccount: name, node: n, enrolled: enrolled,
		ns:  netnstest.NewNS(b.t, "mtlsb-"+name),
		ip4: netip.AddrFrom4([4]byte{10, byte(n.index), 0, byte(last)}),
		ip6: netip.MustParseAddr(fmt.Sprintf("fd00:%d::%x", n.index, last))}
	p.ns.Sysctl(b.t, "ipv6/conf/default/accept_dad", "0")
	p.sb = cnitest.NewSandbox(p.ns, p.namespace, name)
	p.sb.Addrs = []netip.Prefix{netip.PrefixFrom(p.ip4, 24), netip.PrefixFrom(p.ip6, 64)}
	p.sb.Gateways = []netip.Addr{netip.AddrFrom4([4]byte{10, byte(n.index), 0, 1}), netip.MustParseAddr(fmt.Sprintf("fd00:%d::1", n.index))}
	return p
}

// startChurnPod plays the kubelet and the runtime for a pod made by
// newChurnPod: the pod in the API, ADD until it succeeds (each failure
// torn down with DEL, a new sandbox id each time), then its addresses in
// the API. It returns the number of failed ADDs.
func (b *bed) startChurnPod(ctx context.Context, p *bedPod) (int, error) {
	b.cluster.putPod(p)
	ctx, cancel := context.WithTimeout(ctx, 2*bedTimeout)
	defer cancel()
	failures := 0
	for {
		_, err := p.node.runtime.Add(ctx, p.sb)
		if err == nil {
			break
		}
		failures++
		p.node.runtime.Del(context.Background(), p.sb)
		select {
		case <-ctx.Done():
			return failures, fmt.Errorf("%w (last: %v)", ctx.Err(), err)
		case <-time.After(time.Duration(100+rand.IntN(200)) * time.Millisecond):
		}
		p.sb.ContainerID = cnitest.NewSandbox(p.ns, p.namespace, p.name).ContainerID
	}
	p.running, p.published = true, p.enrolled
	b.cluster.putPod(p)
	return failures, nil
}

// stopChurnPod deletes the pod: DEL, then gone from the API.
func (b *bed) stopChurnPod(p *bedPod) {
	if err := p.node.runtime.Del(context.Background(), p.sb); err != nil {
		b.t.Errorf("DEL of %s: %v", p, err)
	}
	if c, ok := b.cluster.(*folderCluster); ok {
		c.mu.Lock()
		defer c.mu.Unlock()
		if err := os.Remove(filepath.Join(c.dir, fmt.Sprintf("pod-%s-%s.yaml", p.namespace, p.name))); err != nil && !errors.Is(err, os.ErrNotExist) {
			b.t.Error(err)
		}
	}
}
