// SPDX-License-Identifier: Apache-2.0

package deploy_test

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"

	"github.com/mtlsbridge/mtlsbridge/identity"
	"github.com/mtlsbridge/mtlsbridge/internal/gomodule"
	"github.com/mtlsbridge/mtlsbridge/proxy"
)

// TestReferenceAgentLeastPrivilege runs the reference mTLS agent as
// deploy/l2/mtlsbridge-proxy.yaml does: its command, its environment as
// the kubelet resolves it (only the paths are the test's), root with
// exactly the capabilities it adds, in a pod of node-a, against the
// sidecar. It becomes ready as its readiness probe asks (xDS applied, a
// certificate for the enrolled pod from the signer, its capture in place);
// without NET_ADMIN it cannot capture, and its log says so.
func TestReferenceAgentLeastPrivilege(t *testing.T) {
	c := newCluster(t)
	bin := t.TempDir()
	gomodule.Build(t, bin, "mtlsbridge-proxy")
	ds := typed[appsv1.DaemonSet](t, find(t, readFile(t, l2Agent), "DaemonSet", "mtlsbridge-proxy"))
	spec := ds.Spec.Template.Spec
	container := &spec.Containers[0]
	if len(container.Command) != 1 || filepath.Base(container.Command[0]) != "mtlsbridge-proxy" || len(container.Args) > 0 {
		t.Fatalf("the DaemonSet runs %q %q, want mtlsbridge-proxy alone", container.Command, container.Args)
	}
	if sc := container.SecurityContext; sc.RunAsUser == nil || *sc.RunAsUser != 0 || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) {
		t.Fatalf("the DaemonSet's security context %+v: this test runs it as root with its added capabilities only", sc)
	}

	// The sidecar listens on the node's address (its $(HOST_IP)), which
	// the agent's pod reaches; on a port of the test's, as the signer
	// runs in the node's namespace here and holds the shipped one.
	hostIP := c.node.Addr4.String()
	shipped := flagString(t, agentFlags(t, c.sidecar, map[string]string{"HOST_IP": hostIP}), "grpc-listen")
	listen := netip.AddrPortFrom(c.node.Addr4, 15112).String()
	sidecar := c.freshRun(t, capsOf(c.sidecar), "--grpc-listen="+listen)
	waitFor(t, sidecar, "the trust bundle", func() error {
		_, err := os.Stat(filepath.Join(sidecar.stateDir, "ca", identity.RootCertFile))
		return err
	})

	// The agent's pod: its own namespace on node-a, and in the API the pod
	// the node's agent knows as its mTLS agent, whose token it presents.
	pod := c.node.AddPod(t, "mtlsproxy")
	// Its token where the agent reads it by default, at the test's path.
	audience := projectedToken(spec.Volumes, container, proxy.DefaultTokenPath)
	if audience == "" {
		t.Fatalf("the DaemonSet projects no token at %s", proxy.DefaultTokenPath)
	}
	token := c.boundTokenFile(t, c.proxyPod, audience)

	env := kubeletEnv(t, container, spec.Volumes, c.proxyPod, pod.IP4, hostIP, map[string]string{"/var/run/mtlsbridge": sidecar.stateDir})
	for i, e := range env {
		name, v, _ := strings.Cut(e, "=")
		if name == proxy.EnvXDSAddress || name == proxy.EnvCAAddress {
			if v != "https://"+shipped {
				t.Errorf("%s=%s, not the sidecar's --grpc-listen (%s)", name, v, shipped)
			}
			env[i] = name + "=https://" + listen
		}
	}
	env = append(env, proxy.EnvAuthToken+"="+token)
	// The kubelet probes the pod's address.
	probe := container.ReadinessProbe.HTTPGet
	ready := func() error {
		_, err := c.getFromNode(fmt.Sprintf("http://%s%s", net.JoinHostPort(pod.IP4.String(), probe.Port.String()), probe.Path), time.Second)
		return err
	}
	argv := []string{filepath.Join(bin, "mtlsbridge-proxy")}

	t.Run("with its capabilities", func(t *testing.T) {
		r := runIn(t, "mtls-agent", pod.NS, argv, capsOf(container), nil, env...)
		waitFor(t, r, "the mTLS agent's readiness probe", ready)
		r.stop()
	})

	t.Run("without NET_ADMIN", func(t *testing.T) {
		caps := slices.DeleteFunc(capsOf(container), func(cp string) bool { return cp == "NET_ADMIN" })
		r := runIn(t, "mtls-agent", pod.NS, argv, caps, nil, env...)
		select {
		case <-r.done:
		case <-time.After(waitLimit):
			t.Fatal("the mTLS agent runs on without NET_ADMIN")
		}
		if log := r.logText(); !strings.Contains(log, "operation not permitted") {
			t.Errorf("its log does not say why:\n%s", log)
		}
	})
}
