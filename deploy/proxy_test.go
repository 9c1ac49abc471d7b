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
	authnv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

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
	audience := projectedToken(&spec, container, proxy.DefaultTokenPath)
	if audience == "" {
		t.Fatalf("the DaemonSet projects no token at %s", proxy.DefaultTokenPath)
	}
	token := podToken(t, c, c.proxyPod, audience)

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

// kubeletEnv is container's environment as the kubelet gives it to a pod
// (its API object pod, with address podIP on a node of address hostIP):
// field references resolved, $(VAR) expanded; a value naming a file
// mounted from a host folder that hostDirs maps is that file in the
// test's folder.
func kubeletEnv(t *testing.T, container *corev1.Container, volumes []corev1.Volume, pod *corev1.Pod, podIP netip.Addr, hostIP string, hostDirs map[string]string) []string {
	t.Helper()
	fields := map[string]string{
		"metadata.name": pod.Name, "metadata.namespace": pod.Namespace, "spec.nodeName": pod.Spec.NodeName,
		"spec.serviceAccountName": pod.Spec.ServiceAccountName, "status.hostIP": hostIP, "status.podIP": podIP.String(),
	}
	resolved := map[string]string{}
	var env []string
	for _, e := range container.Env {
		v := e.Value
		if e.ValueFrom != nil {
			var ok bool
			if v, ok = fields[e.ValueFrom.FieldRef.FieldPath]; !ok {
				t.Fatalf("env %s from %s: unknown to the test", e.Name, e.ValueFrom.FieldRef.FieldPath)
			}
		}
		v = envRef.ReplaceAllStringFunc(v, func(ref string) string { return resolved[envRef.FindStringSubmatch(ref)[1]] })
		host := onHost(container, volumes, v)
		for dir, testDir := range hostDirs {
			if rel, ok := strings.CutPrefix(host, dir+"/"); ok {
				v = filepath.Join(testDir, rel)
			}
		}
		resolved[e.Name] = v
		env = append(env, e.Name+"="+v)
	}
	return env
}

// podToken writes a token of pod's ServiceAccount bound to it, of
// audience, as its projected volume holds one, and returns the file.
func podToken(t *testing.T, c *cluster, pod *corev1.Pod, audience string) string {
	t.Helper()
	tr, err := c.admin.CoreV1().ServiceAccounts(pod.Namespace).CreateToken(t.Context(), pod.Spec.ServiceAccountName, &authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{
		Audiences:      []string{audience},
		BoundObjectRef: &authnv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID},
	}}, metav1.CreateOptions{})
	must(t, err)
	file := filepath.Join(t.TempDir(), "istio-token")
	must(t, os.WriteFile(file, []byte(tr.Status.Token), 0o400))
	return file
}
