// SPDX-License-Identifier: Apache-2.0

package deploy_test

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"

	"github.com/mtlsbridge/mtlsbridge/identity"
	"github.com/mtlsbridge/mtlsbridge/internal/gomodule"
	"github.com/mtlsbridge/mtlsbridge/internal/kubetest"
	"github.com/mtlsbridge/mtlsbridge/proxy"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/inpod"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// TestInPodValuesAreL2sPlusInPod: the in-pod values are the l2 values with
// exactly the differences they mark "In-pod:" (its flags, capabilities, and
// the mounts of the pods' namespaces and the ZDS socket), so that a change
// to one file and not the other fails here.
func TestInPodValuesAreL2sPlusInPod(t *testing.T) {
	l2, inPod := readValues(t, l2Values), readValues(t, inpodValues)
	if diff := cmp.Diff(l2.Rest, inPod.Rest); diff != "" {
		t.Errorf("values besides the sidecar differ (-l2 +in-pod):\n%s", diff)
	}

	// What the in-pod values add; the rest must equal the l2 values'.
	got := inPod.ExtraContainers[0]
	inPodArgs := []string{"--redirect-mode=inpod", "--zds-socket=/var/run/ztunnel/ztunnel.sock", "--netns-dir=/var/run/netns"}
	got.Args = slices.DeleteFunc(slices.Clone(got.Args), func(a string) bool { return slices.Contains(inPodArgs, a) })
	got.VolumeMounts = slices.DeleteFunc(slices.Clone(got.VolumeMounts), func(m corev1.VolumeMount) bool {
		return m.Name == "cilium-netns" || m.Name == "mtlsbridge-zds"
	})
	if added := len(inPod.ExtraContainers[0].Args) - len(got.Args); added != len(inPodArgs) {
		t.Errorf("the in-pod sidecar has %d of the in-pod args %q", added, inPodArgs)
	}
	if added := len(inPod.ExtraContainers[0].VolumeMounts) - len(got.VolumeMounts); added != 2 {
		t.Errorf("the in-pod sidecar has %d of the mounts cilium-netns and mtlsbridge-zds", added)
	}
	if caps := capsOf(&got); !slices.Equal(caps, []string{"NET_ADMIN", "SYS_ADMIN"}) {
		t.Errorf("in-pod capabilities %v, want NET_ADMIN and SYS_ADMIN", caps)
	}
	got.SecurityContext = got.SecurityContext.DeepCopy()
	got.SecurityContext.Capabilities.Add = l2.ExtraContainers[0].SecurityContext.Capabilities.Add
	if diff := cmp.Diff(l2.ExtraContainers[0], got); diff != "" {
		t.Errorf("the sidecars differ beyond the in-pod mode's flags, capabilities and mounts (-l2 +in-pod):\n%s", diff)
	}
	volumes := slices.DeleteFunc(slices.Clone(inPod.ExtraVolumes), func(v corev1.Volume) bool { return v.Name == "mtlsbridge-zds" })
	if diff := cmp.Diff(l2.ExtraVolumes, volumes); diff != "" || len(volumes) == len(inPod.ExtraVolumes) {
		t.Errorf("extraVolumes differ beyond mtlsbridge-zds, which the in-pod values must add (-l2 +in-pod):\n%s", diff)
	}
}

// TestZtunnelWiring: the shipped ztunnel DaemonSet is its node's mTLS agent
// for the in-pod sidecar, and reaches it: the ZDS socket, xDS and CA
// address, the roots it trusts and the token it presents are those the
// sidecar's flags and mounts give, on the same host folders.
func TestZtunnelWiring(t *testing.T) {
	ds, sidecar := ciliumDaemonSet(t, renderCilium(t, inpodValues))
	fs := agentFlags(t, sidecar, map[string]string{"HOST_IP": "$(HOST_IP)"})
	sidecarOnHost := func(p string) string { return onHost(sidecar, ds.Spec.Template.Spec.Volumes, p) }

	zt := ztunnelDaemonSet(t)
	pod := zt.Spec.Template.Spec
	c := &pod.Containers[0]
	ztOnHost := func(p string) string { return onHost(c, pod.Volumes, p) }
	env := map[string]string{}
	for _, e := range c.Env {
		switch {
		case e.ValueFrom != nil && e.ValueFrom.FieldRef != nil:
			env[e.Name] = "field:" + e.ValueFrom.FieldRef.FieldPath
		default:
			env[e.Name] = e.Value
		}
	}

	// Its node's mTLS agent: labelled so, where the sidecar looks, and on
	// the host's network, which a node still in the l2 mode never steers
	// to (redirect's derivation passes over such pods).
	if !pod.HostNetwork || zt.Spec.Template.Labels[tables.RedirTypeLabel] != "proxy" ||
		!slices.Contains(strings.Split(flagString(t, fs, "mtls-agent-namespaces"), ","), zt.Namespace) {
		t.Errorf("ztunnel: hostNetwork %v, labels %v, namespace %s; want hostNetwork, %s=proxy and a namespace of --mtls-agent-namespaces=%s",
			pod.HostNetwork, zt.Spec.Template.Labels, zt.Namespace, tables.RedirTypeLabel, flagString(t, fs, "mtls-agent-namespaces"))
	}
	taint := corev1.Taint{Key: readyTaint, Effect: corev1.TaintEffectNoSchedule}
	if !slices.ContainsFunc(pod.Tolerations, func(tol corev1.Toleration) bool { return tol.ToleratesTaint(klog.Background(), &taint, false) }) {
		t.Errorf("ztunnel tolerates %v: it must run on a node that still has mtlsbridge's readiness taint", pod.Tolerations)
	}

	// ZDS: one socket on the host.
	if got, want := ztOnHost(env["INPOD_UDS"]), sidecarOnHost(flagString(t, fs, "zds-socket")); got != want || strings.HasPrefix(got, "container:") {
		t.Errorf("INPOD_UDS=%s is %s on the host; the sidecar's --zds-socket is %s", env["INPOD_UDS"], got, want)
	}
	// xDS and certificates: the sidecar's listener, where both containers
	// see the node's address as $(HOST_IP).
	wantAddr := "https://" + flagString(t, fs, "grpc-listen")
	if env["HOST_IP"] != "field:status.hostIP" || env["XDS_ADDRESS"] != wantAddr || env["CA_ADDRESS"] != wantAddr ||
		!slices.ContainsFunc(sidecar.Env, func(e corev1.EnvVar) bool {
			return e.Name == "HOST_IP" && e.ValueFrom != nil && e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "status.hostIP"
		}) {
		t.Errorf("HOST_IP %s, XDS_ADDRESS %s, CA_ADDRESS %s: want the node's address and %s (the sidecar's --grpc-listen, its HOST_IP the node's)",
			env["HOST_IP"], env["XDS_ADDRESS"], env["CA_ADDRESS"], wantAddr)
	}
	stateDir := sidecarOnHost(flagString(t, fs, "state-dir"))
	bundle := path.Join(stateDir, "ca", identity.RootCertFile)
	for _, name := range []string{"XDS_ROOT_CA", "CA_ROOT_CA"} {
		if got := ztOnHost(env[name]); got != bundle {
			t.Errorf("%s=%s is %s on the host, want the sidecar's bundle %s", name, env[name], got, bundle)
		}
	}
	// Only the bundle's folder: the state folder holds the sidecar's
	// private socket.
	for _, v := range pod.Volumes {
		if v.HostPath != nil && (stateDir == v.HostPath.Path || strings.HasPrefix(stateDir, strings.TrimSuffix(v.HostPath.Path, "/")+"/")) {
			t.Errorf("ztunnel's volume %s mounts %s, which holds the sidecar's state folder %s", v.Name, v.HostPath.Path, stateDir)
		}
	}
	if env["CLUSTER_ID"] != flagString(t, fs, "cluster-id") {
		t.Errorf("CLUSTER_ID %q, the sidecar's --cluster-id %q", env["CLUSTER_ID"], flagString(t, fs, "cluster-id"))
	}
	// The token ztunnel reads, of an audience the sidecar accepts (the
	// sidecar's CA takes it: TestInPodSidecar); the node named as
	// mtlsbridge's Workloads name it.
	if audience := projectedToken(pod.Volumes, c, ztunnelTokenFile); audience == "" || !slices.Contains(strings.Split(flagString(t, fs, "token-audiences"), ","), audience) {
		t.Errorf("ztunnel's token at %s has audience %q; the sidecar accepts %s", ztunnelTokenFile, audience, flagString(t, fs, "token-audiences"))
	}
	if env["NODE_NAME"] != "field:spec.nodeName" {
		t.Errorf("NODE_NAME is %s, want the node's name (spec.nodeName), which Workloads carry", env["NODE_NAME"])
	}
}

func ztunnelDaemonSet(t *testing.T) *appsv1.DaemonSet {
	t.Helper()
	zt := typed[appsv1.DaemonSet](t, find(t, readFile(t, inpodAgent), "DaemonSet", "ztunnel"))
	if n := len(zt.Spec.Template.Spec.Containers); n != 1 {
		t.Fatalf("ztunnel's pod has %d containers", n)
	}
	return zt
}

// ztunnelTokenFile is where ztunnel reads its token without AUTH_TOKEN
// (the DaemonSet sets none).
const ztunnelTokenFile = "/var/run/secrets/tokens/istio-token"

// TestInPodSidecar runs the sidecar of the in-pod values, its args and
// capabilities (NET_ADMIN and SYS_ADMIN instead of the l2 mode's BPF and
// PERFMON), with the test's paths. It finds the enrolled pod's namespace
// among the runtime's pinned ones (no CNI report: mtlsbridge was installed
// after it started), writes its redirection there, and with --probe-snat
// (Cilium's settings those of its legacy host routing) makes the node's
// own connections reach the pod past it, with no ztunnel running yet. Then
// the reference agent runs as ztunnel's DaemonSet runs ztunnel (its
// environment, user and capabilities, on the host's network) and takes
// the pod over ZDS, with xDS and the pod's certificate, until its
// readiness probe passes. Switched from the l2 sidecar, it hands the l2
// agent's pins over and removes them, with its own capabilities only.
// Under Cilium's BPF host routing the sidecar SNATs nothing, and its
// readiness output says why. Without SYS_ADMIN it cannot enter the pod's
// namespace: its log and the pod's row say so.
func TestInPodSidecar(t *testing.T) {
	c := newCluster(t)
	netnsDir := t.TempDir()
	c.web.NS.Pin(t, filepath.Join(netnsDir, "web"))
	// Short: UNIX socket paths are limited to 108 bytes.
	zdsDir, err := os.MkdirTemp("", "mtlsb-zds-")
	must(t, err)
	t.Cleanup(func() { os.RemoveAll(zdsDir) })
	c.web.Serve(t, "web", 8080, false, c.web.IP4, c.web.IP6)
	ciliumConfig := func(settings map[string]string) string {
		dir := t.TempDir()
		for key, value := range settings {
			must(t, os.WriteFile(filepath.Join(dir, key), []byte(value), 0o644))
		}
		return dir
	}
	legacyRouting := ciliumConfig(map[string]string{"kube-proxy-replacement": "true", "enable-host-legacy-routing": "true"})
	bpfRouting := ciliumConfig(map[string]string{"kube-proxy-replacement": "true", "enable-bpf-masquerade": "true"})
	// The last of a flag given twice holds: the test's paths, and the
	// probe SNAT the values leave to the operator.
	flags := func(ciliumConfig string) []string {
		return []string{"--zds-socket=" + filepath.Join(zdsDir, "ztunnel.sock"),
			"--netns-dir=" + netnsDir, "--netns-search-min-age=0s", "--probe-snat",
			"--cilium-config-dir=" + ciliumConfig}
	}
	l2Sidecar := c.sidecar
	_, inPodSidecar := ciliumDaemonSet(t, renderCilium(t, inpodValues))
	c.sidecar = inPodSidecar
	// ztunnel's pod on node-a, as its DaemonSet makes it.
	zt := ztunnelDaemonSet(t)
	_, err = c.admin.CoreV1().ServiceAccounts(zt.Namespace).Create(t.Context(),
		&corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: zt.Spec.Template.Spec.ServiceAccountName}}, metav1.CreateOptions{})
	must(t, err)
	ztunnel := kubetest.CreateRunningPod(t, c.admin, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "ztunnel-a", Namespace: zt.Namespace, Labels: zt.Spec.Template.Labels},
		Spec: corev1.PodSpec{NodeName: "node-a", ServiceAccountName: zt.Spec.Template.Spec.ServiceAccountName,
			HostNetwork: zt.Spec.Template.Spec.HostNetwork},
	}, c.node.Addr4.String())
	ztunnelToken := c.boundTokenFile(t, ztunnel, projectedToken(zt.Spec.Template.Spec.Volumes, &zt.Spec.Template.Spec.Containers[0], ztunnelTokenFile))
	proxyBin := t.TempDir()
	gomodule.Build(t, proxyBin, "mtlsbridge-proxy")
	// runZtunnel runs the reference agent, which runs as ztunnel does in
	// its in-pod mode, as ztunnel's DaemonSet runs ztunnel: its
	// environment as the kubelet gives it (the test's paths; its token at
	// the test's path), its user and capabilities, on the host's network
	// (its address the node's, which is the sidecar's $(HOST_IP),
	// 127.0.0.1, here); and waits for its readiness probe (xDS applied,
	// the local pods' certificates held).
	runZtunnel := func(t *testing.T, sidecar *agentRun) *agentRun {
		t.Helper()
		spec := &zt.Spec.Template.Spec
		container := &spec.Containers[0]
		loopback := netip.MustParseAddr("127.0.0.1")
		env := kubeletEnv(t, container, spec.Volumes, ztunnel, loopback, loopback.String(),
			map[string]string{"/var/run/mtlsbridge": sidecar.stateDir, "/var/run/ztunnel": zdsDir})
		sc := container.SecurityContext
		r := runIn(t, "ztunnel", c.node.NS, []string{filepath.Join(proxyBin, "mtlsbridge-proxy")}, capsOf(container),
			&execUser{UID: int(*sc.RunAsUser), GID: int(*sc.RunAsGroup)}, append(env, proxy.EnvAuthToken+"="+ztunnelToken)...)
		probe := container.ReadinessProbe.HTTPGet
		waitFor(t, r, "ztunnel's readiness probe", func() error {
			_, err := c.getFromNode(fmt.Sprintf("http://%s%s", net.JoinHostPort(probe.Host, probe.Port.String()), probe.Path), time.Second)
			return err
		})
		return r
	}
	caps := capsOf(c.sidecar)
	withoutSysAdmin := slices.DeleteFunc(slices.Clone(caps), func(cp string) bool { return cp == "SYS_ADMIN" })
	if len(withoutSysAdmin) == len(caps) {
		t.Fatalf("the in-pod sidecar adds %v, no SYS_ADMIN", caps)
	}

	t.Run("without SYS_ADMIN", func(t *testing.T) {
		c.reset(t)
		r := c.freshRun(t, withoutSysAdmin, flags(legacyRouting)...)
		logSays(t, r, "Cannot redirect an enrolled pod", "app/web", "operation not permitted")
		shellSays(t, c, r, []string{"db/show", "inpod"}, "app/web", "network namespace unknown")
		r.stop()
	})

	t.Run("with SYS_ADMIN", func(t *testing.T) {
		c.reset(t)
		r := c.freshRun(t, caps, flags(legacyRouting)...)
		shellSays(t, c, r, []string{"db/show", "inpod"}, "app/web", "/web", "Done")
		for i, probe := range []netip.Addr{inpod.ProbeSNAT4, inpod.ProbeSNAT6} {
			dst := netip.AddrPortFrom([]netip.Addr{c.web.IP4, c.web.IP6}[i], 8080)
			waitFor(t, r, "the node's connection to "+dst.String()+" from the probe address", func() error {
				got, err := c.node.Ask(dst)
				if err == nil && (got.Server != "web" || got.Remote.Addr() != probe) {
					err = fmt.Errorf("answered %v", got)
				}
				return err
			})
		}

		// ztunnel's DaemonSet on the node takes the pod over ZDS, with xDS
		// and the pod's certificate from the sidecar.
		ztunnel := runZtunnel(t, r)
		shellSays(t, c, r, []string{"db/show", "zds"}, "app/web", "acked")
		ztunnel.stop()
		r.stop()
	})

	// A node switched from l2 as README's install says: the in-pod
	// sidecar, with its own capabilities, hands the l2 agent's pins over
	// and removes them once ztunnel has the pod.
	t.Run("switched from l2", func(t *testing.T) {
		c.reset(t)
		c.sidecar = l2Sidecar
		defer func() { c.sidecar = inPodSidecar }()
		l2 := c.freshRun(t, capsOf(l2Sidecar))
		waitFor(t, l2, "app/web redirected in the l2 mode", c.webAnnotated)
		l2.stop()
		if pins, _ := os.ReadDir(c.bpfRoot); len(pins) == 0 {
			t.Fatalf("the l2 agent left nothing pinned under %s to hand over", c.bpfRoot)
		}
		c.sidecar = inPodSidecar
		r := c.start(t, l2.stateDir, l2.cniConf, l2.cniBin, caps, flags(legacyRouting)...)
		ztunnel := runZtunnel(t, r)
		waitFor(t, r, "the l2 pins handed over and removed", func() error {
			if pins, _ := os.ReadDir(c.bpfRoot); len(pins) > 0 {
				return fmt.Errorf("%d pins left under %s", len(pins), c.bpfRoot)
			}
			return nil
		})
		shellSays(t, c, r, []string{"db/show", "inpod"}, "app/web", "Done")
		ztunnel.stop()
		r.stop()
	})

	// Under Cilium's BPF host routing the pod's replies would leave by the
	// uplink: nothing is SNATed (the table written above goes), and the
	// readiness probe's output says why.
	t.Run("under BPF host routing", func(t *testing.T) {
		c.reset(t)
		r := c.freshRun(t, caps, flags(bpfRouting)...)
		healthSays(t, c, r, `"probe-snat"`, "BPF host routing")
		dst := netip.AddrPortFrom(c.web.IP4, 8080)
		waitFor(t, r, "the node's connection to "+dst.String()+" redirected in the pod (refused: no ztunnel)", func() error {
			if got, err := c.node.Ask(dst); !errors.Is(err, syscall.ECONNREFUSED) {
				return fmt.Errorf("answered %v, %v", got, err)
			}
			return nil
		})
		r.stop()
	})
}
