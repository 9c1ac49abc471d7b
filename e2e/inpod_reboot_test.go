// SPDX-License-Identifier: Apache-2.0

package e2e_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/mtlsbridge/mtlsbridge/internal/cnitest"
	"github.com/mtlsbridge/mtlsbridge/internal/netnstest"
	"github.com/mtlsbridge/mtlsbridge/proxy"
)

// TestInPodReboot: node-a of the in-pod testbed loses power. Its node agent
// and mTLS agent die, its state folder (on a memory file system) is gone,
// and so are the pods' sandboxes: at boot each pod gets a new sandbox in a
// new network namespace, half of them with new addresses, while the API
// still shows the old ones. The runtime adds them through CNI before the
// node agent runs, and the mTLS agent comes after it. Every pod is re-added
// (to ztunnel, over ZDS, in its new namespace), none starts before its
// redirection and the agent's listeners are in it, and enrolled pods talk
// mTLS both ways again; nothing leaks.
func TestInPodReboot(t *testing.T) {
	b := newBedWith(t, newFolderCluster(t), bedConfig{inPod: true})
	na, nb := b.nodes[0], b.nodes[1]
	r := nb.addPod("r", "app", true, false)
	var pods []*bedPod
	for i := range 6 {
		pods = append(pods, na.addPod(fmt.Sprintf("p%d", i), "app", i%3 != 2, false))
	}
	var enrolled []string
	var enrolledAddrs []netip.Addr
	for _, p := range pods {
		if p.enrolled {
			enrolled = append(enrolled, p.name)
			enrolledAddrs = append(enrolledAddrs, p.ip4, p.ip6)
			b.knows(na, p, r, true)
			expectMTLS(t, b.run(p, r, false))
		}
	}

	// Power loss: no DEL, no stop hook; the state folder is cleared and the
	// sandboxes vanish with their interfaces.
	na.killAgent()
	na.killProxy()
	must(t, os.RemoveAll(filepath.Join(na.stateDir, "cni-pods")))
	for _, p := range pods {
		h := p.ns.Netlink(t)
		eth0, err := h.LinkByName("eth0")
		must(t, err)
		must(t, h.LinkDel(eth0))
	}
	// New sandboxes in new namespaces; half with new addresses, which the
	// API learns only once their ADD returned.
	newAddrs := map[*bedPod][2]netip.Addr{}
	for i, p := range pods {
		uid, gateways := p.sb.UID, p.sb.Gateways
		p.ns = netnstest.NewNS(t, "mtlsb-"+p.name)
		p.ns.Sysctl(t, "ipv6/conf/default/accept_dad", "0")
		p.sb = cnitest.NewSandbox(p.ns, p.namespace, p.name)
		p.sb.UID, p.sb.Gateways = uid, gateways
		ip4, ip6 := p.ip4, p.ip6
		if i%2 == 0 {
			na.mu.Lock()
			last := na.nextAddr
			na.nextAddr++
			na.mu.Unlock()
			ip4 = netip.AddrFrom4([4]byte{10, 1, 0, byte(last)})
			ip6 = netip.MustParseAddr(fmt.Sprintf("fd00:1::%x", last))
			if p.enrolled {
				enrolledAddrs = append(enrolledAddrs, ip4, ip6)
			}
		}
		newAddrs[p] = [2]netip.Addr{ip4, ip6}
		p.sb.Addrs = []netip.Prefix{netip.PrefixFrom(ip4, 24), netip.PrefixFrom(ip6, 64)}
	}

	// Boot: the runtime re-adds the pods at once; the node agent comes a
	// second later, the mTLS agent after it.
	time.AfterFunc(time.Second, na.startAgent)
	time.AfterFunc(2*time.Second, na.startProxy)
	ctx, cancel := context.WithTimeout(context.Background(), 2*bedTimeout)
	defer cancel()
	var wg sync.WaitGroup
	errs := make([]error, len(pods))
	for i, p := range pods {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				_, err := na.runtime.Add(ctx, p.sb)
				if err == nil {
					break
				}
				na.runtime.Del(context.Background(), p.sb)
				if ctx.Err() != nil {
					errs[i] = fmt.Errorf("%s did not start again: %v", p, err)
					return
				}
				time.Sleep(time.Duration(100+rand.IntN(200)) * time.Millisecond)
				p.sb.ContainerID = cnitest.NewSandbox(p.ns, p.namespace, p.name).ContainerID
			}
			if p.enrolled {
				errs[i] = inPodInPlace(p)
			}
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
	if t.Failed() {
		t.FailNow()
	}
	// The kubelet writes the new addresses; the pods' servers run again.
	for _, p := range pods {
		p.ip4, p.ip6 = newAddrs[p][0], newAddrs[p][1]
		b.cluster.putPod(p)
		serveDigest(t, p)
		serveEcho(t, p)
	}
	na.waitProxyReady()
	b.eventually("every enrolled pod of node-a redirected and held", func() error { return na.noBypass(enrolled...) })
	for _, p := range pods {
		if !p.enrolled {
			expectPlainInPod(t, b.run(p, r, false), false, true)
			continue
		}
		b.knows(na, p, r, true)
		b.knows(nb, r, p, true)
		for _, v6 := range []bool{false, true} {
			f := b.run(p, r, v6)
			t.Log(f)
			expectMTLS(t, f)
			f = b.run(r, p, v6)
			t.Log(f)
			expectMTLS(t, f)
		}
	}
	time.Sleep(captureLag)
	for _, s := range b.underlay.Segments() {
		hbone := s.Src.Port() == proxy.HBONEPort || s.Dst.Port() == proxy.HBONEPort
		if !hbone && (slices.Contains(enrolledAddrs, s.Src.Addr()) || slices.Contains(enrolledAddrs, s.Dst.Addr())) {
			t.Errorf("an enrolled pod's TCP outside HBONE on the underlay: %s", s)
		}
	}
}
