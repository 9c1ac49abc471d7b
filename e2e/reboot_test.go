// SPDX-License-Identifier: Apache-2.0

package e2e_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"
)

// TestReboot: a node with running pods loses power. Its pinned BPF state
// and its state folder (both on memory file systems) are gone, and so are
// the pods' sandboxes; the API still shows the pods with their old
// addresses. At boot the runtime re-adds every pod through CNI, before the
// agent runs, and half of them get new addresses. Every enrolled pod ends up
// redirected, none starts before its redirect, and nothing leaks.
func TestReboot(t *testing.T) {
	n := newNode(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*addTimeout)
	defer cancel()
	n.start()

	var pods []*pod
	var enrolled []string
	for i := range 8 {
		p := n.newPod(fmt.Sprintf("p%d", i), i%4 != 3)
		pods = append(pods, p)
		if p.enrolled {
			enrolled = append(enrolled, p.name)
		}
	}
	slices.Sort(enrolled)
	hostIfs := make([]string, len(pods))
	// boot starts every pod's sandbox and lets it run a second; the API
	// learns the addresses at once, or (apiLater) only once boot returns.
	boot := func(what string, apiLater bool) *traffic {
		var tr traffic
		var wg sync.WaitGroup
		for i, p := range pods {
			wg.Add(1)
			go func() {
				defer wg.Done()
				hostIf, _, err := n.startSandbox(ctx, p)
				if err != nil {
					t.Errorf("%s: %v", what, err)
					return
				}
				hostIfs[i] = hostIf
				if !apiLater {
					n.writePod(p, true)
				}
				stop := make(chan struct{})
				time.AfterFunc(time.Second, func() { close(stop) })
				n.run(p, stop, &tr)
			}()
		}
		wg.Wait()
		return &tr
	}
	before := boot("first start", false)
	n.waitNoBypass(enrolled)

	// Power loss: no DEL, no stop hook; memory file systems are cleared
	// and the sandboxes' interfaces vanish.
	n.kill()
	must(t, os.RemoveAll(filepath.Join(n.bpfRoot, "agent")))
	must(t, os.RemoveAll(filepath.Join(n.stateDir, "cni-pods")))
	h := n.node.Netlink(t)
	for _, name := range hostIfs {
		link, err := h.LinkByName(name)
		must(t, err)
		must(t, h.LinkDel(link))
	}
	for i, p := range pods {
		p.sb.ContainerID = newContainerID(p)
		if i%2 == 0 {
			n.assignAddrs(p) // the API keeps showing the old ones until ADD returns
		}
	}

	// Boot: the runtime re-adds the pods at once; the agent comes later.
	time.AfterFunc(time.Second, n.start)
	after := boot("after the reboot", true)
	// The bypass check judges the new sandboxes by their addresses, which
	// the API does not show yet; then the kubelet catches up.
	n.waitNoBypass(enrolled)
	for _, p := range pods {
		n.writePod(p, true)
	}
	n.waitNoBypass(enrolled)

	leaked, plain := n.checkNoLeak(t, after)
	t.Logf("%d pods (%d enrolled) re-added through CNI after the reboot, %d with new addresses; "+
		"connections before %d (%d via the agent), after %d (%d via the agent); "+
		"%d segments on the uplink, %d with payload from pods not enrolled, %d from enrolled pods, %d of them with payload",
		len(pods), len(enrolled), (len(pods)+1)/2, before.sent.Load(), before.agent.Load(), after.sent.Load(), after.agent.Load(),
		len(n.capture.Segments()), plain, len(leaked), payload(leaked))
}
