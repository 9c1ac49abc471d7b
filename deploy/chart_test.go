// SPDX-License-Identifier: Apache-2.0

package deploy_test

import (
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/yaml"

	"github.com/mtlsbridge/mtlsbridge/cni/install"
	"github.com/mtlsbridge/mtlsbridge/cni/plugin"
	"github.com/mtlsbridge/mtlsbridge/internal/kubetest"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/inpod"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/steering"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// TestCiliumChartRendersSidecar renders Cilium's chart with each mode's
// shipped values and checks the DaemonSet it would run: the sidecar as
// written, its mounts on volumes that exist, the folders behind its flags
// on the host, the identity it runs as, and its privileges.
func TestCiliumChartRendersSidecar(t *testing.T) {
	for valuesFile, mode := range map[string]string{l2Values: "l2", inpodValues: "inpod"} {
		t.Run(mode, func(t *testing.T) { checkRenderedSidecar(t, valuesFile, mode) })
	}
}

func checkRenderedSidecar(t *testing.T, valuesFile, mode string) {
	objs := renderCilium(t, valuesFile)
	ds, c := ciliumDaemonSet(t, objs)
	pod := ds.Spec.Template.Spec

	// The chart copies extraContainers verbatim: what runs is what the
	// values say, field for field.
	values := readValues(t, valuesFile)
	if !reflect.DeepEqual(values.ExtraContainers[0], *c) {
		t.Errorf("the rendered sidecar differs from the values' extraContainers[0]:\nrendered %+v\nvalues   %+v", *c, values.ExtraContainers)
	}

	// Every mount names a volume of the pod, and extraVolumes never
	// redefine one of Cilium's (a duplicate name is rejected by the API
	// server, or worse, shadows Cilium's).
	volumes := map[string]corev1.Volume{}
	for _, v := range pod.Volumes {
		if _, dup := volumes[v.Name]; dup {
			t.Errorf("volume %s is defined twice in the pod", v.Name)
		}
		volumes[v.Name] = v
	}
	for _, m := range c.VolumeMounts {
		if _, ok := volumes[m.Name]; !ok {
			t.Errorf("mount %s at %s: the pod has no such volume", m.Name, m.MountPath)
		}
	}
	for _, v := range values.ExtraVolumes {
		if !strings.HasPrefix(v.Name, "mtlsbridge-") {
			t.Errorf("extra volume %s: name it mtlsbridge-*, so that it never collides with Cilium's", v.Name)
		}
	}

	// The folders behind the agent's flags, as the host sees them. The
	// state folder must be the same path inside and outside: the CNI
	// plugin, run by the container runtime on the host, reads it from the
	// conflist.
	fs := agentFlags(t, c, map[string]string{"HOST_IP": "192.0.2.1"})
	if got := flagString(t, fs, "redirect-mode"); got != mode {
		t.Fatalf("%s: --redirect-mode=%s, want %s", valuesFile, got, mode)
	}
	host := func(flag string) string { return onHost(c, pod.Volumes, flagString(t, fs, flag)) }
	wantOnHost := map[string]string{
		"state-dir":              "/var/run/mtlsbridge",
		"bpf-root":               "/sys/fs/bpf/mtlsbridge",
		"cni-conf-dir":           "/etc/cni/net.d",
		"cni-bin-dir":            "/opt/cni/bin",
		"ca-upstream-roots":      "volume:mtlsbridge-ca-roots",
		"ca-upstream-token-file": "volume:mtlsbridge-signer-token",
	}
	if mode == "inpod" {
		// Where ztunnel's INPOD_UDS is (TestZtunnelWiring), and where the
		// runtime pins the namespaces the CNI plugin reports.
		wantOnHost["zds-socket"] = "/var/run/ztunnel/ztunnel.sock"
		wantOnHost["netns-dir"] = "/var/run/netns"
		// A namespace pinned after the container started must show in it.
		for _, m := range c.VolumeMounts {
			if m.MountPath == flagString(t, fs, "netns-dir") && (m.MountPropagation == nil || *m.MountPropagation != corev1.MountPropagationHostToContainer) {
				t.Errorf("the pods' namespaces are mounted without HostToContainer propagation: %+v", m)
			}
		}
	}
	for flag, want := range wantOnHost {
		if got := host(flag); got != want {
			t.Errorf("--%s=%s is %s on the host, want %s", flag, flagString(t, fs, flag), got, want)
		}
	}
	if got := flagString(t, fs, "state-dir"); got != host("state-dir") {
		t.Errorf("--state-dir=%s is %s on the host: the CNI plugin would look in the wrong place", got, host("state-dir"))
	}
	if flagString(t, fs, "source") != "k8s" || flagString(t, fs, "cni-install") != "true" {
		t.Errorf("want --source=k8s and --cni-install; got %s, %s", flagString(t, fs, "source"), flagString(t, fs, "cni-install"))
	}
	checkSignerWiring(t, fs, ds, c)

	// Who the sidecar is: the pod's ServiceAccount, the subject of
	// mtlsbridge's ClusterRoleBinding.
	if pod.ServiceAccountName != ciliumAccount || ds.Namespace != ciliumNS {
		t.Errorf("the DaemonSet runs as %s/%s, want %s/%s", ds.Namespace, pod.ServiceAccountName, ciliumNS, ciliumAccount)
	}
	binding := typed[rbacv1.ClusterRoleBinding](t, find(t, readManifests(t), "ClusterRoleBinding", "mtlsbridge"))
	if len(binding.Subjects) != 1 || binding.Subjects[0].Kind != "ServiceAccount" ||
		binding.Subjects[0].Namespace != ds.Namespace || binding.Subjects[0].Name != pod.ServiceAccountName {
		t.Errorf("ClusterRoleBinding mtlsbridge binds %+v, not the sidecar's account %s/%s", binding.Subjects, ds.Namespace, pod.ServiceAccountName)
	}
	if !pod.HostNetwork {
		t.Error("the Cilium pod is not hostNetwork: --grpc-listen=$(HOST_IP) would not be the node's address")
	}

	// Privileges: root without privileged, every capability dropped but
	// the ones named (TestAgentLeastPrivilege runs the agent with exactly
	// those).
	sc := c.SecurityContext
	if sc == nil || sc.Capabilities == nil {
		t.Fatal("the sidecar has no security context with capabilities")
	}
	if sc.Privileged != nil && *sc.Privileged {
		t.Error("the sidecar is privileged")
	}
	if !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) {
		t.Errorf("capabilities dropped: %v, want [ALL]", sc.Capabilities.Drop)
	}
	if sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
		t.Error("the sidecar's root file system is writable")
	}

	// Probes the kubelet can run: readiness gets /healthz where
	// --health-serve-addr serves it, on the loopback (the pod is on the
	// host's network); liveness runs the image's binary (no shell).
	healthAddr := flagString(t, fs, "health-serve-addr")
	if rp := c.ReadinessProbe; rp == nil || rp.HTTPGet == nil || rp.HTTPGet.Path != "/healthz" ||
		net.JoinHostPort(rp.HTTPGet.Host, rp.HTTPGet.Port.String()) != healthAddr || !netip.MustParseAddrPort(healthAddr).Addr().IsLoopback() {
		t.Errorf("readiness probe: want an httpGet of /healthz at --health-serve-addr=%s on the loopback, got %+v", healthAddr, rp)
	}
	if lp := c.LivenessProbe; lp == nil || lp.Exec == nil || len(lp.Exec.Command) == 0 || lp.Exec.Command[0] != "/usr/local/bin/mtlsbridge" {
		t.Errorf("liveness probe: want an exec of /usr/local/bin/mtlsbridge, got %+v", lp)
	}
	// Every container port is a node port: the agent's TCP listeners take
	// none that Cilium's chart uses by default, or another container of
	// the pod declares.
	taken := ciliumChartPorts(t)
	for _, other := range slices.Concat(pod.InitContainers, pod.Containers) {
		for _, port := range other.Ports {
			if other.Name != c.Name {
				taken[int(port.ContainerPort)] = other.Name + " container port " + port.Name
			}
		}
	}
	for _, flag := range []string{"health-serve-addr", "prometheus-serve-addr"} {
		_, port, err := net.SplitHostPort(flagString(t, fs, flag))
		must(t, err)
		n, err := strconv.Atoi(port)
		must(t, err)
		if what, ok := taken[n]; ok {
			t.Errorf("--%s uses port %d, which Cilium's %s takes", flag, n, what)
		}
	}
	// The metrics port is declared, by name, for a PodMonitor.
	metricsPort := flagString(t, fs, "prometheus-serve-addr")
	if !slices.ContainsFunc(c.Ports, func(p corev1.ContainerPort) bool {
		return p.Name != "" && ":"+strconv.Itoa(int(p.ContainerPort)) == metricsPort && p.HostPort == p.ContainerPort
	}) {
		t.Errorf("the sidecar declares no named port for --prometheus-serve-addr=%s: %+v", metricsPort, c.Ports)
	}

	// The CNI chain: Cilium reads its conflist from the shipped ConfigMap.
	cfg := find(t, objs, "ConfigMap", "cilium-config")
	readConf, _, _ := unstructured.NestedString(cfg.Object, "data", "read-cni-conf")
	writeConf, _, _ := unstructured.NestedString(cfg.Object, "data", "write-cni-conf-when-ready")
	if readConf != "/tmp/cni-configuration/cni-config" || writeConf != "/host/etc/cni/net.d/"+install.PreferredConflist {
		t.Errorf("cilium-config: read-cni-conf=%q write-cni-conf-when-ready=%q; want Cilium to write the ConfigMap's conflist as %s",
			readConf, writeConf, install.PreferredConflist)
	}
	if v, ok := volumes["cni-configuration"]; !ok || v.ConfigMap == nil || v.ConfigMap.Name != "mtlsbridge-cni-configuration" {
		t.Errorf("the pod's cni-configuration volume is %+v, want ConfigMap mtlsbridge-cni-configuration", volumes["cni-configuration"])
	}
	// Services are translated at the socket in pods' namespaces, as the
	// agent's own check of Cilium's rendered configuration says.
	configDir := t.TempDir()
	rendered, _, _ := unstructured.NestedStringMap(cfg.Object, "data")
	for k, v := range rendered {
		must(t, os.WriteFile(filepath.Join(configDir, k), []byte(v), 0o600))
	}
	if err := steering.ServicesAtSocket(configDir); err != nil {
		t.Errorf("Cilium's rendered configuration: %v", err)
	}
	if got := host("cilium-config-dir"); got != "volume:tmp" {
		t.Errorf("--cilium-config-dir=%s is %s, want in Cilium's tmp volume, where its init container writes the configuration",
			flagString(t, fs, "cilium-config-dir"), got)
	}
	if flagString(t, fs, "cni-conflist") != install.PreferredConflist {
		t.Errorf("--cni-conflist=%s, want the file Cilium writes (%s)", flagString(t, fs, "cni-conflist"), install.PreferredConflist)
	}
}

// TestCNIConfigMapMatchesAgentFlags: the conflist Cilium writes from the
// shipped ConfigMap already holds, last, exactly the entry the agent's
// installer would write for the sidecar's flags. Otherwise the installer
// would change the file, Cilium (cni.exclusive) would write it back, and
// the two would rewrite it in turn. (The in-pod values have the same
// flags: TestInPodValuesAreL2sPlusInPod.)
func TestCNIConfigMapMatchesAgentFlags(t *testing.T) {
	objs := renderCilium(t, l2Values)
	_, c := ciliumDaemonSet(t, objs)
	fs := agentFlags(t, c, map[string]string{"HOST_IP": "192.0.2.1"})

	cm := find(t, readManifests(t), "ConfigMap", "mtlsbridge-cni-configuration")
	conflist, _, _ := unstructured.NestedString(cm.Object, "data", "cni-config")
	var conf struct {
		CNIVersion string           `json:"cniVersion"`
		Plugins    []map[string]any `json:"plugins"`
	}
	must(t, json.Unmarshal([]byte(conflist), &conf))
	if len(conf.Plugins) != 2 || conf.Plugins[0]["type"] != "cilium-cni" || conf.Plugins[1]["type"] != install.PluginType {
		t.Fatalf("plugins %v: want cilium-cni, then %s", conf.Plugins, install.PluginType)
	}
	// Cilium's own entry as it renders it by default (chaining mode none,
	// the chart's cni.logFile).
	if conf.Plugins[0]["log-file"] != "/var/run/cilium/cilium-cni.log" || conf.Plugins[0]["enable-debug"] != false {
		t.Errorf("cilium-cni entry %v differs from Cilium's default", conf.Plugins[0])
	}

	dir := t.TempDir()
	file := filepath.Join(dir, install.PreferredConflist)
	must(t, os.WriteFile(file, []byte(conflist), 0o644))
	wait, err := time.ParseDuration(flagString(t, fs, "cni-wait"))
	must(t, err)
	entry := plugin.Entry(flagString(t, fs, "state-dir"), flagString(t, fs, "cni-fail-policy"),
		strings.Split(flagString(t, fs, "excluded-namespaces"), ","), wait)
	wrote, err := install.InsertEntry(file, entry)
	must(t, err)
	if wrote {
		after, _ := os.ReadFile(file)
		t.Errorf("the agent's installer would rewrite the ConfigMap's conflist:\nConfigMap:\n%s\ninstaller:\n%s", conflist, after)
	}
}

// ciliumChartPorts collects the ports Cilium's chart names in its default
// values (under a key "port", "...Port" or "...Address": a number, or a
// string of one or ending in :NUMBER), with their keys. Ports fixed in
// its templates alone are not seen.
func ciliumChartPorts(t *testing.T) map[int]string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(kubetest.CiliumChart(t), "values.yaml"))
	must(t, err)
	var values map[string]any
	must(t, yaml.Unmarshal(data, &values))
	ports := map[int]string{}
	var walk func(path string, v any)
	walk = func(path string, v any) {
		switch v := v.(type) {
		case map[string]any:
			for k, child := range v {
				key := path + "." + k
				if k == "port" || strings.HasSuffix(k, "Port") || strings.HasSuffix(k, "Address") {
					if n := portOf(child); n > 0 {
						ports[n] = "value " + key[1:]
						continue
					}
				}
				walk(key, child)
			}
		case []any:
			for i, child := range v {
				walk(fmt.Sprintf("%s[%d]", path, i), child)
			}
		}
	}
	walk("", values)
	if len(ports) < 10 {
		t.Fatalf("found %d ports in Cilium's values.yaml, want its many: %v", len(ports), ports)
	}
	return ports
}

// portOf reads a port from a chart value: 9962, "9962" or ":9962".
func portOf(v any) int {
	switch v := v.(type) {
	case float64:
		return int(v)
	case string:
		if i := strings.LastIndex(v, ":"); i >= 0 {
			v = v[i+1:]
		}
		n, _ := strconv.Atoi(v)
		return n
	}
	return 0
}

// signerPolicy is the part of a CiliumNetworkPolicy the signer's is read
// for: whom its ingress rules let reach which ports. Read strictly (typed):
// a rule naming peers another way (fromEndpoints, fromCIDR, ...) fails.
type signerPolicy struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              struct {
		EndpointSelector metav1.LabelSelector `json:"endpointSelector"`
		Ingress          []struct {
			FromEntities []string `json:"fromEntities"`
			ToPorts      []struct {
				Ports []struct {
					Port     string `json:"port"`
					Protocol string `json:"protocol"`
				} `json:"ports"`
			} `json:"toPorts"`
		} `json:"ingress"`
	} `json:"spec"`
}

// checkSignerPolicy: the signer's CiliumNetworkPolicy selects its pods and
// lets its gRPC and probe ports be reached from nodes (host, remote-node)
// only, no pod; mtlsbridge reads it as a valid policy that enrolls no one.
func checkSignerPolicy(t *testing.T, obj *unstructured.Unstructured, signer *appsv1.Deployment, grpcPort, probePort string) {
	t.Helper()
	p := typed[signerPolicy](t, obj)
	selector, err := metav1.LabelSelectorAsSelector(&p.Spec.EndpointSelector)
	must(t, err)
	if p.Namespace != signer.Namespace || !selector.Matches(labels.Set(signer.Spec.Template.Labels)) {
		t.Errorf("the signer's policy (%s, %s) does not select its pods (%s, %v)", p.Namespace, selector, signer.Namespace, signer.Spec.Template.Labels)
	}
	for i, rule := range p.Spec.Ingress {
		if len(rule.ToPorts) == 0 {
			t.Errorf("the signer's policy: ingress rule %d names no port, so it opens them all", i)
		}
	}
	for _, port := range []string{grpcPort, probePort} {
		var from []string
		for _, rule := range p.Spec.Ingress {
			for _, to := range rule.ToPorts {
				for _, pp := range to.Ports {
					if pp.Port == port && pp.Protocol == "TCP" {
						from = append(from, rule.FromEntities...)
					}
				}
			}
		}
		if slices.Sort(from); !slices.Equal(from, []string{"host", "remote-node"}) {
			t.Errorf("the signer's port %s is reachable from %v, want the nodes only [host remote-node]", port, from)
		}
	}
	parsed := tables.ParsePolicy(tables.KindCNP, p.Namespace, p.Name, obj.Object)
	if parsed.Error != "" || parsed.RequiresAuthentication() {
		t.Errorf("mtlsbridge reads the signer's policy as error %q, requiring authentication %v", parsed.Error, parsed.RequiresAuthentication())
	}
}

// probeSNATPolicy is the optional CiliumClusterwideNetworkPolicy of the
// in-pod mode, read strictly.
type probeSNATPolicy struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              struct {
		Description       string               `json:"description"`
		EndpointSelector  metav1.LabelSelector `json:"endpointSelector"`
		EnableDefaultDeny struct {
			Ingress *bool `json:"ingress"`
			Egress  *bool `json:"egress"`
		} `json:"enableDefaultDeny"`
		Ingress []struct {
			FromCIDR []string `json:"fromCIDR"`
		} `json:"ingress"`
	} `json:"spec"`
}

// TestProbeSNATPolicy: the optional policy of the in-pod mode lets the
// addresses the node agent SNATs probes to, and nothing else, reach every
// pod, without putting any pod into default deny; mtlsbridge reads it as a
// valid policy that enrolls no one.
func TestProbeSNATPolicy(t *testing.T) {
	obj := find(t, readFile(t, "optional/mtlsbridge-probe-snat-ingress.yaml"), "CiliumClusterwideNetworkPolicy", "mtlsbridge-probe-snat-ingress")
	p := typed[probeSNATPolicy](t, obj)
	if sel := p.Spec.EndpointSelector; len(sel.MatchLabels)+len(sel.MatchExpressions) > 0 {
		t.Errorf("the policy selects %v, want every pod", sel)
	}
	if deny := p.Spec.EnableDefaultDeny; deny.Ingress == nil || *deny.Ingress || deny.Egress == nil || *deny.Egress {
		t.Errorf("enableDefaultDeny %+v: want ingress and egress false, or pods it selects alone lose all other traffic", deny)
	}
	want := []string{netip.PrefixFrom(inpod.ProbeSNAT4, 32).String(), netip.PrefixFrom(inpod.ProbeSNAT6, 128).String()}
	if len(p.Spec.Ingress) != 1 || !slices.Equal(p.Spec.Ingress[0].FromCIDR, want) {
		t.Errorf("ingress %+v, want one rule from %v only", p.Spec.Ingress, want)
	}
	parsed := tables.ParsePolicy(tables.KindCCNP, "", p.Name, obj.Object)
	if parsed.Error != "" || parsed.RequiresAuthentication() {
		t.Errorf("mtlsbridge reads the policy as error %q, requiring authentication %v", parsed.Error, parsed.RequiresAuthentication())
	}
}

// checkSignerWiring: the sidecar reaches the signer of
// deploy/kubernetes/mtlsbridge-signer.yaml (its Service's name and port,
// which its certificate names and its container serves), with a token of
// an audience it accepts, and decides enrollment with the same flags; the
// signer's paths are its mounts and its probe its health port; and no
// volume of the Cilium pod holds the CA Secret: no node may read the key.
func checkSignerWiring(t *testing.T, fs *pflag.FlagSet, ds *appsv1.DaemonSet, sidecar *corev1.Container) {
	t.Helper()
	objs := readFile(t, "kubernetes/mtlsbridge-signer.yaml")
	svc := typed[corev1.Service](t, find(t, objs, "Service", "mtlsbridge-signer"))
	signer := typed[appsv1.Deployment](t, find(t, objs, "Deployment", "mtlsbridge-signer"))
	container := &signer.Spec.Template.Spec.Containers[0]
	sfs := signerFlags(t, container)

	want := net.JoinHostPort(svc.Name+"."+svc.Namespace+".svc", strconv.Itoa(int(svc.Spec.Ports[0].Port)))
	if got := flagString(t, fs, "ca-upstream"); got != want {
		t.Errorf("--ca-upstream=%s, want the signer's Service %s", got, want)
	}
	if host, _, _ := net.SplitHostPort(want); !slices.Contains(strings.Split(flagString(t, sfs, "grpc-serving-names"), ","), host) {
		t.Errorf("the signer's certificate names %s, not %s", flagString(t, sfs, "grpc-serving-names"), host)
	}
	containerPort := func(name string) string {
		for _, p := range container.Ports {
			if p.Name == name {
				return strconv.Itoa(int(p.ContainerPort))
			}
		}
		return "none"
	}
	if _, port, _ := net.SplitHostPort(flagString(t, sfs, "grpc-listen")); port != containerPort(svc.Spec.Ports[0].TargetPort.String()) {
		t.Errorf("the signer listens on %s, its Service targets port %s", port, svc.Spec.Ports[0].TargetPort.String())
	}
	if _, port, _ := net.SplitHostPort(flagString(t, sfs, "health-serve-addr")); port != container.ReadinessProbe.HTTPGet.Port.String() {
		t.Errorf("the signer's /healthz is on port %s, its probe asks %s", port, container.ReadinessProbe.HTTPGet.Port.String())
	}
	checkSignerPolicy(t, find(t, objs, "CiliumNetworkPolicy", "mtlsbridge-signer"), signer,
		containerPort(svc.Spec.Ports[0].TargetPort.String()), container.ReadinessProbe.HTTPGet.Port.String())
	for _, flag := range []string{"trust-domain", "excluded-namespaces", "mtls-agent-namespaces", "cluster-name"} {
		if flagString(t, fs, flag) != flagString(t, sfs, flag) {
			t.Errorf("--%s: the sidecar's %q, the signer's %q", flag, flagString(t, fs, flag), flagString(t, sfs, flag))
		}
	}

	// Paths: each flag names what its volume holds.
	mountOf := func(c *corev1.Container, volumes []corev1.Volume, name string) (string, *corev1.Volume) {
		for _, m := range c.VolumeMounts {
			if m.Name == name {
				return m.MountPath, volumeNamed(volumes, name)
			}
		}
		t.Fatalf("container %s mounts no volume %s", c.Name, name)
		return "", nil
	}
	tokenDir, token := mountOf(sidecar, ds.Spec.Template.Spec.Volumes, "mtlsbridge-signer-token")
	if src := token.Projected.Sources[0].ServiceAccountToken; flagString(t, fs, "ca-upstream-token-file") != path.Join(tokenDir, src.Path) ||
		!strings.Contains(","+flagString(t, sfs, "token-audiences")+",", ","+src.Audience+",") {
		t.Errorf("--ca-upstream-token-file=%s: the token is %s/%s, of audience %q (the signer accepts %s)",
			flagString(t, fs, "ca-upstream-token-file"), tokenDir, src.Path, src.Audience, flagString(t, sfs, "token-audiences"))
	}
	rootsDir, roots := mountOf(sidecar, ds.Spec.Template.Spec.Volumes, "mtlsbridge-ca-roots")
	if flagString(t, fs, "ca-upstream-roots") != path.Join(rootsDir, "roots.pem") || roots.ConfigMap == nil || roots.ConfigMap.Name != "mtlsbridge-ca-roots" {
		t.Errorf("--ca-upstream-roots=%s, not roots.pem of the ConfigMap mtlsbridge-ca-roots at %s", flagString(t, fs, "ca-upstream-roots"), rootsDir)
	}
	caDir, ca := mountOf(container, signer.Spec.Template.Spec.Volumes, "ca")
	if flagString(t, sfs, "ca-dir") != caDir || ca.Secret == nil || ca.Secret.SecretName != "mtlsbridge-ca" {
		t.Errorf("the signer's --ca-dir=%s is not the Secret mtlsbridge-ca's mount", flagString(t, sfs, "ca-dir"))
	}
	stateDir, state := mountOf(container, signer.Spec.Template.Spec.Volumes, "state")
	if rel, err := filepath.Rel(stateDir, flagString(t, sfs, "state-dir")); err != nil || strings.HasPrefix(rel, "..") || rel == "." || state.EmptyDir == nil {
		t.Errorf("the signer's --state-dir=%s is not a folder inside its emptyDir at %s (it must own it)", flagString(t, sfs, "state-dir"), stateDir)
	}

	for _, v := range ds.Spec.Template.Spec.Volumes {
		secret := v.Secret != nil && v.Secret.SecretName == "mtlsbridge-ca"
		if v.Projected != nil {
			for _, src := range v.Projected.Sources {
				secret = secret || src.Secret != nil && src.Secret.Name == "mtlsbridge-ca"
			}
		}
		if secret {
			t.Errorf("volume %s mounts the CA Secret on every node", v.Name)
		}
	}
}
