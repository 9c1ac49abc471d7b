// SPDX-License-Identifier: Apache-2.0

package deploy_test

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	pb "istio.io/api/security/v1alpha1"
	appsv1 "k8s.io/api/apps/v1"
	authnv1 "k8s.io/api/authentication/v1"
	authzv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/mtlsbridge/mtlsbridge/identity"
	"github.com/mtlsbridge/mtlsbridge/internal/gomodule"
	"github.com/mtlsbridge/mtlsbridge/internal/kubetest"
	"github.com/mtlsbridge/mtlsbridge/internal/netnstest"
)

const (
	ciliumUser = "system:serviceaccount:kube-system:cilium"
	signerUser = "system:serviceaccount:kube-system:mtlsbridge-signer"
	waitLimit  = 60 * time.Second
	// The audit policy: every request of the sidecar's and the signer's
	// identities, nothing else, at the level that names verb and resource.
	auditPolicy = `apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: Metadata
  users: ["` + ciliumUser + `", "` + signerUser + `"]
- level: None
`
)

// permission is one verb on one resource, as RBAC and the audit log name
// them.
type permission struct{ group, resource, verb string }

func (p permission) String() string {
	g := p.group
	if g == "" {
		g = "core"
	}
	return p.verb + " " + g + "/" + p.resource
}

// granted expands a ClusterRole's rules into permissions.
func granted(role *rbacv1.ClusterRole) map[permission]bool {
	out := map[permission]bool{}
	for _, r := range role.Rules {
		for _, g := range r.APIGroups {
			for _, res := range r.Resources {
				for _, v := range r.Verbs {
					out[permission{g, res, v}] = true
				}
			}
		}
	}
	return out
}

// cluster is the test's world: a node of network namespaces with the mTLS
// agent's pod and an enrolled pod, and a real API server holding the
// matching objects, the shipped RBAC and admission policy.
type cluster struct {
	t        *testing.T
	srv      *kubetest.Server
	admin    kubernetes.Interface
	node     *netnstest.Node
	proxyPod *corev1.Pod // the mTLS agent's pod in the API
	web      *netnstest.Pod
	role     *rbacv1.ClusterRole
	bin      string // folder with mtlsbridge and mtlsbridge-cni
	// The sidecar as Cilium's chart renders it with the shipped values.
	sidecar *corev1.Container
	// sidecarVolumes are the Cilium pod's volumes.
	sidecarVolumes []corev1.Volume
	apiAddr        string // the API server, as seen from inside the node
	kubecfg        string // the sidecar's credentials: a token of kube-system/cilium only
	token          *rest.Config
	// The current run's bpffs folder (each run starts without pins, so that
	// it must load and attach the programs itself).
	bpfRoot string
	// The CA of create-ca-secret.sh, the signer's; the sidecar's files as
	// the kubelet mounts them: the roots ConfigMap's and its token for the
	// signer.
	secret      *corev1.Secret
	rootsFile   string
	signerToken string
	// signer is the signer's run, as its Deployment runs it.
	signer *agentRun
}

func newCluster(t *testing.T) *cluster {
	t.Helper()
	netnstest.RequirePrivileged(t)
	c := &cluster{t: t}
	ds, sidecar := ciliumDaemonSet(t, renderCilium(t, l2Values))
	c.sidecar, c.sidecarVolumes = sidecar, ds.Spec.Template.Spec.Volumes

	nodeA, nodeB := netnstest.NewNodes(t)
	// Its uplink is a veth, as a kind node's eth0, with the default route:
	// the agent, given no --devices, must find it.
	must(t, nodeA.Netlink(t).RouteAdd(&netlink.Route{LinkIndex: nodeA.Uplink.Attrs().Index, Gw: nodeB.Addr4.AsSlice()}))
	c.node = nodeA
	proxy := nodeA.AddPod(t, "proxy")
	proxy.MakeAgent(t)
	web := nodeA.AddPod(t, "web")
	c.web = web

	c.srv = kubetest.StartServer(t, kubetest.Options{AuditPolicy: auditPolicy})
	kubetest.ApplyCiliumCRDs(t, c.srv.Config)
	c.admin = kubernetes.NewForConfigOrDie(c.srv.Config)
	dyn := dynamic.NewForConfigOrDie(c.srv.Config)
	ctx := t.Context()
	installShipped(t, c.srv.Config, c.admin, "kubernetes/mtlsbridge-rbac.yaml", "kubernetes/mtlsbridge-admission-policy.yaml",
		"kubernetes/mtlsbridge-signer.yaml")
	c.role = typed[rbacv1.ClusterRole](t, find(t, readFile(t, "kubernetes/mtlsbridge-rbac.yaml"), "ClusterRole", "mtlsbridge"))

	// The node, provisioned with mtlsbridge's readiness taint.
	_, err := c.admin.CoreV1().Nodes().Create(ctx, &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: "node-a"},
		Spec:       corev1.NodeSpec{Taints: []corev1.Taint{{Key: readyTaint, Effect: corev1.TaintEffectNoSchedule}}},
		Status:     corev1.NodeStatus{Addresses: []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: nodeA.Addr4.String()}}},
	}, metav1.CreateOptions{})
	must(t, err)
	_, err = c.admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "app"}}, metav1.CreateOptions{})
	must(t, err)
	_, err = c.admin.CoreV1().ServiceAccounts(ciliumNS).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "mtlsbridge-proxy"}}, metav1.CreateOptions{})
	must(t, err)

	// A policy requiring authentication enrolls web; Cilium gave it an
	// identity. A clusterwide policy that selects nothing is listed too.
	for _, o := range []struct {
		gvr schema.GroupVersionResource
		ns  string
		obj map[string]any
	}{
		{kubetest.CNPResource, "app", map[string]any{"apiVersion": "cilium.io/v2", "kind": "CiliumNetworkPolicy",
			"metadata": map[string]any{"name": "web-mtls", "namespace": "app"},
			"spec": map[string]any{
				"endpointSelector": map[string]any{"matchLabels": map[string]any{"app": "web"}},
				"ingress":          []any{map[string]any{"authentication": map[string]any{"mode": "required"}}},
			}}},
		{kubetest.CCNPResource, "", map[string]any{"apiVersion": "cilium.io/v2", "kind": "CiliumClusterwideNetworkPolicy",
			"metadata": map[string]any{"name": "other"},
			"spec": map[string]any{
				"endpointSelector": map[string]any{"matchLabels": map[string]any{"app": "other"}},
				"egress":           []any{map[string]any{"toEntities": []any{"world"}}},
			}}},
		{kubetest.CEPResource, "app", map[string]any{"apiVersion": "cilium.io/v2", "kind": "CiliumEndpoint",
			"metadata": map[string]any{"name": "web", "namespace": "app"},
			"status":   map[string]any{"identity": map[string]any{"id": int64(4242)}}}},
	} {
		var res dynamic.ResourceInterface = dyn.Resource(o.gvr)
		if o.ns != "" {
			res = dyn.Resource(o.gvr).Namespace(o.ns)
		}
		_, err := res.Create(ctx, &unstructured.Unstructured{Object: o.obj}, metav1.CreateOptions{})
		must(t, err)
	}

	ips := func(p *netnstest.Pod) []string { return []string{p.IP4.String(), p.IP6.String()} }
	cilium := ciliumPod(t, c.admin, "node-a")
	c.proxyPod = kubetest.CreateRunningPod(t, c.admin, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "mtlsbridge-proxy-a", Namespace: ciliumNS, Labels: map[string]string{"cilium.io/redir-type": "proxy"}},
		Spec:       corev1.PodSpec{NodeName: "node-a", ServiceAccountName: "mtlsbridge-proxy"},
	}, ips(proxy)...)
	kubetest.CreateRunningPod(t, c.admin, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "web", Namespace: "app", Labels: map[string]string{"app": "web"}},
		// As the ServiceAccount admission plugin, off here, would set it.
		Spec: corev1.PodSpec{NodeName: "node-a", ServiceAccountName: "default"},
	}, ips(web)...)

	// The agent runs in the node's namespace, as the sidecar runs in the
	// node's (hostNetwork), and reaches the API server there.
	c.apiAddr = nodeA.Relay(t, "127.0.0.1:0", strings.TrimPrefix(c.srv.Config.Host, "https://"))
	c.token = tokenConfig(t, c.srv.Config, c.admin, cilium)
	c.kubecfg = sidecarKubeconfig(t, c.token, "https://"+c.apiAddr)
	c.bin = buildAgent(t)
	c.startSigner(t, cilium)
	return c
}

// startSigner runs the signer as its Deployment does, in the node's
// namespace at the node's address (as if its pod were there), named by its
// Service's EndpointSlice; and writes the sidecar's files for it: the
// roots, and its pod's token with the audience of the values' volume.
func (c *cluster) startSigner(t *testing.T, cilium *corev1.Pod) {
	t.Helper()
	ctx := t.Context()
	var roots *corev1.ConfigMap
	c.secret, roots = createCAObjects(t, "cluster.local")
	c.rootsFile = filepath.Join(t.TempDir(), "roots.pem")
	must(t, os.WriteFile(c.rootsFile, []byte(roots.Data["roots.pem"]), 0o444))
	// The token the sidecar reads for the signer, bound to its pod.
	tokenFile := flagString(t, agentFlags(t, c.sidecar, map[string]string{"HOST_IP": "127.0.0.1"}), "ca-upstream-token-file")
	audience := projectedToken(c.sidecarVolumes, c.sidecar, tokenFile)
	if audience == "" {
		t.Fatalf("the sidecar's pod projects no token at --ca-upstream-token-file=%s", tokenFile)
	}
	c.signerToken = c.boundTokenFile(t, cilium, audience)

	deployment := typed[appsv1.Deployment](t, find(t, readFile(t, "kubernetes/mtlsbridge-signer.yaml"), "Deployment", "mtlsbridge-signer"))
	account := deployment.Spec.Template.Spec.ServiceAccountName
	signerTR, err := c.admin.CoreV1().ServiceAccounts(ciliumNS).CreateToken(ctx, account,
		&authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{ExpirationSeconds: new(int64(3600))}}, metav1.CreateOptions{})
	must(t, err)
	kubeconfig := sidecarKubeconfig(t, &rest.Config{BearerToken: signerTR.Status.Token, TLSClientConfig: rest.TLSClientConfig{CAData: c.srv.Config.CAData}}, "https://"+c.apiAddr)

	// The signer runs as its pod's user, with its volumes as the kubelet
	// makes them: owned by root and the pod's fsGroup, the Secret's files
	// of the volume's mode, the emptyDir writable by all.
	pod := &deployment.Spec.Template.Spec
	container := &pod.Containers[0]
	user := &execUser{UID: int(*pod.SecurityContext.RunAsUser), GID: int(*pod.SecurityContext.RunAsGroup), Groups: []int{int(*pod.SecurityContext.FSGroup)}}
	volumes, err := os.MkdirTemp("", "mtlsb-signer-")
	must(t, err)
	t.Cleanup(func() { os.RemoveAll(volumes) })
	asVolume := func(path string, mode os.FileMode) {
		must(t, os.Chown(path, 0, int(*pod.SecurityContext.FSGroup)))
		must(t, os.Chmod(path, mode))
	}
	asVolume(volumes, 0o755)
	caDir, emptyDir := filepath.Join(volumes, "ca"), filepath.Join(volumes, "state")
	must(t, os.Mkdir(caDir, 0o755))
	for name, data := range c.secret.Data {
		must(t, os.WriteFile(filepath.Join(caDir, name), data, 0o400))
		asVolume(filepath.Join(caDir, name), os.FileMode(*volumeNamed(pod.Volumes, "ca").Secret.DefaultMode))
	}
	must(t, os.Mkdir(emptyDir, 0o700))
	asVolume(emptyDir, 0o777|os.ModeSetgid)
	kubeconfigData, err := os.ReadFile(kubeconfig)
	must(t, err)
	kubeconfig = filepath.Join(volumes, "kubeconfig") // the token's stand-in
	must(t, os.WriteFile(kubeconfig, kubeconfigData, 0o400))
	asVolume(kubeconfig, 0o440)
	// Its executable, in the test's folder (t.TempDir: two levels).
	for _, dir := range []string{c.bin, filepath.Dir(c.bin)} {
		must(t, os.Chmod(dir, 0o755))
	}
	stateMount := ""
	for _, m := range container.VolumeMounts {
		if m.Name == "state" {
			stateMount = m.MountPath
		}
	}
	stateDir := filepath.Join(emptyDir, strings.TrimPrefix(flagString(t, signerFlags(t, container), "state-dir"), stateMount))
	args := overridden(t, "the signer", container.Args, map[string]string{
		"--state-dir":             stateDir,
		"--ca-dir":                caDir,
		"--grpc-listen":           net.JoinHostPort(c.node.Addr4.String(), "15012"),
		"--prometheus-serve-addr": "127.0.0.1:0",
		"--health-serve-addr":     "127.0.0.1:0",
	})
	c.signer = c.runInNode(t, "signer", append([]string{filepath.Join(c.bin, "mtlsbridge")}, append(args, "--kubeconfig="+kubeconfig)...), nil, user)
	c.signer.stateDir = stateDir
	waitFor(t, c.signer, "the signer's readiness", func() error {
		out, err := exec.Command(filepath.Join(c.bin, "mtlsbridge"), "health", "--state-dir="+stateDir).CombinedOutput()
		if err != nil {
			return fmt.Errorf("%v: %s", err, out)
		}
		return nil
	})
	if uid, err := effectiveUID(c.signer.cmd.Process.Pid); err != nil || uid != user.UID {
		t.Fatalf("the signer runs as uid %d (%v), not its pod's %d", uid, err, user.UID)
	}

	ready := true
	_, err = c.admin.DiscoveryV1().EndpointSlices(ciliumNS).Create(ctx, &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: "mtlsbridge-signer-node-a", Labels: map[string]string{discoveryv1.LabelServiceName: "mtlsbridge-signer"}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Endpoints:   []discoveryv1.Endpoint{{Addresses: []string{c.node.Addr4.String()}, Conditions: discoveryv1.EndpointConditions{Ready: &ready}}},
		Ports:       []discoveryv1.EndpointPort{{Name: new("grpc"), Port: new(int32(15012))}},
	}, metav1.CreateOptions{})
	must(t, err)
}

// overridden is a container's args with the values of override, each of
// which the args must set.
func overridden(t *testing.T, who string, args []string, override map[string]string) []string {
	t.Helper()
	var out []string
	for _, a := range args {
		name, _, _ := strings.Cut(a, "=")
		if v, ok := override[name]; ok {
			a = name + "=" + v
			delete(override, name)
		}
		out = append(out, a)
	}
	if len(override) > 0 {
		t.Fatalf("%s's args lack %v", who, override)
	}
	return out
}

// sidecarKubeconfig writes the credentials the sidecar has in a cluster:
// its pod's token, the cluster's CA, nothing else.
func sidecarKubeconfig(t *testing.T, cfg *rest.Config, server string) string {
	t.Helper()
	kc := clientcmdapi.NewConfig()
	kc.Clusters["c"] = &clientcmdapi.Cluster{Server: server, CertificateAuthorityData: cfg.CAData}
	kc.AuthInfos["sidecar"] = &clientcmdapi.AuthInfo{Token: cfg.BearerToken}
	kc.Contexts["c"] = &clientcmdapi.Context{Cluster: "c", AuthInfo: "sidecar"}
	kc.CurrentContext = "c"
	path := filepath.Join(t.TempDir(), "kubeconfig")
	must(t, clientcmd.WriteToFile(*kc, path))
	return path
}

// buildAgent builds mtlsbridge and mtlsbridge-cni into one folder (the
// agent installs the plugin from beside its own executable).
func buildAgent(t *testing.T) string {
	dir := t.TempDir()
	gomodule.Build(t, dir, "mtlsbridge", "mtlsbridge-cni")
	return dir
}

// agentRun is one run of the sidecar's command.
type agentRun struct {
	cmd      *exec.Cmd
	log      string
	stateDir string
	cniConf  string
	cniBin   string
	done     chan struct{}
}

// start runs the agent with the sidecar's args from the rendered chart
// ($(HOST_IP) is the node's loopback, where the test reaches it), with the
// capabilities its securityContext adds and no others, in the node's
// namespace. Only paths and the check interval differ from a cluster's:
// the test's folders and its bpffs folder.
func (c *cluster) start(t *testing.T, stateDir, cniConf, cniBin string, caps []string, flags ...string) *agentRun {
	t.Helper()
	args := []string{filepath.Join(c.bin, "mtlsbridge")}
	for _, a := range overridden(t, "the sidecar", c.sidecar.Args, map[string]string{
		"--state-dir":              stateDir,
		"--bpf-root":               c.bpfRoot,
		"--ca-upstream-roots":      c.rootsFile,
		"--ca-upstream-token-file": c.signerToken,
		"--cni-conf-dir":           cniConf,
		"--cni-bin-dir":            cniBin,
	}) {
		args = append(args, strings.ReplaceAll(a, "$(HOST_IP)", "127.0.0.1"))
	}
	args = append(args, "--kubeconfig="+c.kubecfg, "--bypass-check-interval=1s")
	r := c.runInNode(t, "agent", append(args, flags...), caps, nil)
	r.stateDir, r.cniConf, r.cniBin = stateDir, cniConf, cniBin
	return r
}

// runInNode runs argv in the node's namespace with exactly caps, logging
// to a file of its own, until the test ends.
func (c *cluster) runInNode(t *testing.T, name string, argv, caps []string, user *execUser) *agentRun {
	t.Helper()
	return runIn(t, name, c.node.NS, argv, caps, user, "NODE_NAME=node-a", "HOST_IP=127.0.0.1")
}

// runIn runs argv in ns with exactly caps, as user if given, with env
// added to the test's, logging to a file of its own, until the test ends.
func runIn(t *testing.T, name string, ns *netnstest.NS, argv, caps []string, user *execUser, env ...string) *agentRun {
	t.Helper()
	spec, err := json.Marshal(execSpec{Netns: "/run/netns/" + ns.Name, Caps: caps, User: user, Argv: argv})
	must(t, err)
	r := &agentRun{log: filepath.Join(t.TempDir(), name+".log"), done: make(chan struct{})}
	logFile, err := os.Create(r.log)
	must(t, err)
	r.cmd = exec.Command(os.Args[0])
	r.cmd.Env = append(append(os.Environ(), execEnv+"="+string(spec)), env...)
	r.cmd.Stdout, r.cmd.Stderr = logFile, logFile
	r.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	must(t, r.cmd.Start())
	go func() { r.cmd.Wait(); logFile.Close(); close(r.done) }()
	t.Cleanup(func() {
		r.stop()
		if t.Failed() {
			b, _ := os.ReadFile(r.log)
			t.Logf("%s log:\n%s", name, b[max(0, len(b)-32<<10):])
		}
	})
	return r
}

func (r *agentRun) stop() {
	select {
	case <-r.done:
		return
	default:
	}
	r.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-r.done:
	case <-time.After(10 * time.Second):
		r.cmd.Process.Kill()
		<-r.done
	}
}

func (r *agentRun) logText() string {
	b, _ := os.ReadFile(r.log)
	return string(b)
}

// probe runs one of the sidecar's probes against this run: an httpGet
// from the node's namespace, as the kubelet of a host-network pod, or an
// exec.
func (c *cluster) probe(r *agentRun, p *corev1.Probe) error {
	timeout := time.Duration(p.TimeoutSeconds) * time.Second
	if get := p.HTTPGet; get != nil {
		_, err := c.getFromNode(fmt.Sprintf("http://%s%s", net.JoinHostPort(get.Host, get.Port.String()), get.Path), timeout)
		return err
	}
	argv := slices.Clone(p.Exec.Command)
	argv[0] = filepath.Join(c.bin, "mtlsbridge")
	for i, a := range argv {
		if strings.HasPrefix(a, "--state-dir=") {
			argv[i] = "--state-dir=" + r.stateDir
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	out, err := exec.CommandContext(ctx, argv[0], argv[1:]...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%v: %w\n%s", argv[1:], err, out)
	}
	return nil
}

// getFromNode fetches url from inside the node's namespace, as the kubelet
// and Prometheus of a host-network pod do; a status that is no success (as
// a probe counts it: 200 to 399) is an error.
func (c *cluster) getFromNode(url string, timeout time.Duration) ([]byte, error) {
	resp, err := c.node.HTTPClient(timeout).Get(url)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if resp.StatusCode < 200 || resp.StatusCode >= 400 {
		return body, fmt.Errorf("GET %s: %s\n%s", url, resp.Status, body)
	}
	return body, err
}

// waitFor polls cond until it holds, or fails the test after waitLimit.
func waitFor(t *testing.T, r *agentRun, what string, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(waitLimit)
	for {
		err := cond()
		if err == nil {
			return
		}
		select {
		case <-r.done:
			t.Fatalf("the agent exited while waiting for %s (%v)", what, err)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("waiting for %s: %v", what, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// freshRun starts the agent with its own state and CNI folders (a CNI
// folder as Cilium leaves it with the shipped ConfigMap), the given
// capabilities, and flags added to the sidecar's.
func (c *cluster) freshRun(t *testing.T, caps []string, flags ...string) *agentRun {
	t.Helper()
	stateDir, err := os.MkdirTemp("", "mtlsb-") // short: UNIX socket paths
	must(t, err)
	t.Cleanup(func() { os.RemoveAll(stateDir) })
	cniConf, cniBin := t.TempDir(), t.TempDir()
	must(t, os.WriteFile(filepath.Join(cniConf, "05-cilium.conflist"), []byte(shippedConflist(t, stateDir)), 0o600))
	c.bpfRoot = filepath.Join(netnstest.BPFRoot(t), "mtlsbridge")
	return c.start(t, stateDir, cniConf, cniBin, caps, flags...)
}

// shippedConflist is the ConfigMap's conflist for an agent whose state
// folder is stateDir (the test's, not /var/run/mtlsbridge).
func shippedConflist(t *testing.T, stateDir string) string {
	t.Helper()
	cm := find(t, readManifests(t), "ConfigMap", "mtlsbridge-cni-configuration")
	conflist, _, _ := unstructured.NestedString(cm.Object, "data", "cni-config")
	const shipped = `"stateDir": "/var/run/mtlsbridge"`
	if !strings.Contains(conflist, shipped) {
		t.Fatalf("the ConfigMap's conflist has no %s", shipped)
	}
	return strings.Replace(conflist, shipped, `"stateDir": "`+stateDir+`"`, 1)
}

// caRequest asks the agent's CA, as the node's mTLS agent does, for the
// web pod's identity: a TokenReview of the proxy pod's token.
func (c *cluster) caRequest(t *testing.T, r *agentRun) (*pb.IstioCertificateResponse, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	bundle, err := os.ReadFile(filepath.Join(r.stateDir, "ca", identity.RootCertFile))
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(bundle)
	dial := func(ctx context.Context, addr string) (net.Conn, error) {
		var conn net.Conn
		err := c.node.Do(func() error {
			var err error
			conn, err = (&net.Dialer{Timeout: 3 * time.Second}).DialContext(ctx, "tcp", addr)
			return err
		})
		return conn, err
	}
	conn, err := grpc.NewClient("passthrough:///127.0.0.1:15012", grpc.WithContextDialer(dial),
		grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{RootCAs: pool, ServerName: "127.0.0.1"})))
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	must(t, err)
	id, _ := url.Parse("spiffe://cluster.local/ns/app/sa/default")
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{URIs: []*url.URL{id}}, key)
	must(t, err)
	ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+c.boundToken(t, c.proxyPod, "istio-ca"))
	return pb.NewIstioCertificateServiceClient(conn).CreateCertificate(ctx, &pb.IstioCertificateRequest{
		Csr: string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der})),
	})
}

// boundToken is a token of pod's ServiceAccount, bound to pod, of
// audience, as the kubelet projects one.
func (c *cluster) boundToken(t *testing.T, pod *corev1.Pod, audience string) string {
	t.Helper()
	tr, err := c.admin.CoreV1().ServiceAccounts(pod.Namespace).CreateToken(t.Context(), pod.Spec.ServiceAccountName, &authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{
		Audiences:      []string{audience},
		BoundObjectRef: &authnv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID},
	}}, metav1.CreateOptions{})
	must(t, err)
	return tr.Status.Token
}

// boundTokenFile is boundToken written to a file of its own, as the
// kubelet mounts it.
func (c *cluster) boundTokenFile(t *testing.T, pod *corev1.Pod, audience string) string {
	t.Helper()
	file := filepath.Join(t.TempDir(), "token")
	must(t, os.WriteFile(file, []byte(c.boundToken(t, pod, audience)), 0o400))
	return file
}

func (c *cluster) webAnnotated() error {
	p, err := c.admin.CoreV1().Pods("app").Get(c.t.Context(), "web", metav1.GetOptions{})
	if err != nil {
		return err
	}
	if p.Annotations[redirAnnotation] != "ready" {
		return fmt.Errorf("app/web's annotations: %v", p.Annotations)
	}
	return nil
}

func (c *cluster) taintGone() error {
	n, err := c.admin.CoreV1().Nodes().Get(c.t.Context(), "node-a", metav1.GetOptions{})
	if err != nil {
		return err
	}
	if slices.ContainsFunc(n.Spec.Taints, func(t corev1.Taint) bool { return t.Key == readyTaint }) {
		return fmt.Errorf("node-a still has the taint: %v", n.Spec.Taints)
	}
	return nil
}

// reset puts the API back as before the agent ran: the web pod without
// the annotation, node-a with the taint.
func (c *cluster) reset(t *testing.T) {
	t.Helper()
	ctx := t.Context()
	// As mtlsbridge: the admission policy keeps every other identity off
	// its annotation.
	_, err := kubernetes.NewForConfigOrDie(c.token).CoreV1().Pods("app").Patch(ctx, "web", "application/merge-patch+json",
		[]byte(`{"metadata":{"annotations":{"`+redirAnnotation+`":null}}}`), metav1.PatchOptions{})
	must(t, err)
	n, err := c.admin.CoreV1().Nodes().Get(ctx, "node-a", metav1.GetOptions{})
	must(t, err)
	if slices.ContainsFunc(n.Spec.Taints, func(t corev1.Taint) bool { return t.Key == readyTaint }) {
		return
	}
	n.Spec.Taints = append(n.Spec.Taints, corev1.Taint{Key: readyTaint, Effect: corev1.TaintEffectNoSchedule})
	_, err = c.admin.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{})
	must(t, err)
}

// used reads the audit log: every permission the sidecar's identity
// exercised, and those refused.
func (c *cluster) used(t *testing.T) (used, refused map[permission]int, streamed map[permission]bool) {
	return c.usedBy(t, ciliumUser)
}

// usedBy is used for any user.
func (c *cluster) usedBy(t *testing.T, user string) (used, refused map[permission]int, streamed map[permission]bool) {
	t.Helper()
	events, err := kubetest.ReadAuditLog(c.srv.AuditLog)
	must(t, err)
	used, refused, streamed = map[permission]int{}, map[permission]int{}, map[permission]bool{}
	for _, e := range events {
		if e.User.Username != user || e.ObjectRef == nil {
			continue
		}
		res := e.ObjectRef.Resource
		if e.ObjectRef.Subresource != "" {
			res += "/" + e.ObjectRef.Subresource
		}
		p := permission{e.ObjectRef.APIGroup, res, e.Verb}
		if e.ResponseStatus != nil && e.ResponseStatus.Code == 403 {
			refused[p]++
		} else {
			used[p]++
		}
		// A watch that streams the initial state (client-go's watch-list,
		// the API server's WatchList) stands in for a list.
		if e.Verb == "watch" && strings.Contains(e.RequestURI, "sendInitialEvents=true") {
			streamed[permission{p.group, p.resource, "list"}] = true
		}
	}
	return used, refused, streamed
}

var forbiddenRE = regexp.MustCompile(`(?i)forbidden`)

// TestAgentLeastPrivilege runs the agent as the sidecar runs in a
// cluster, from the rendered chart's args: as root with only the
// capabilities its securityContext adds, in the node's network namespace,
// authenticated to a real API server only by a token of its
// ServiceAccount kube-system/cilium, which only the shipped ClusterRole
// grants anything (and the admission policy narrows). It lists and
// watches, enrolls the pod a policy selects, redirects it in the kernel,
// annotates it, removes the node's taint, reviews the mTLS agent's token
// for a certificate, and leaves the CNI conflist Cilium wrote alone, with
// no "forbidden" anywhere in its log. The audit log then shows every
// permission it used: one the ClusterRole lacks fails the test, and so
// does one granted but never used.
func TestAgentLeastPrivilege(t *testing.T) {
	c := newCluster(t)
	r := c.freshRun(t, capsOf(c.sidecar))

	// The agent really runs with the sidecar's capabilities and no more.
	want := capMask(t, capsOf(c.sidecar))
	waitFor(t, r, "the agent's process", func() error {
		got, err := effectiveCaps(r.cmd.Process.Pid)
		if err == nil && got != want {
			return fmt.Errorf("effective capabilities %#x, want %#x", got, want)
		}
		return err
	})

	// Ready, as the kubelet would see it through the readiness probe.
	waitFor(t, r, "the readiness probe", func() error { return c.probe(r, c.sidecar.ReadinessProbe) })
	must(t, c.probe(r, c.sidecar.LivenessProbe))
	// Prometheus scrapes the node's address where --prometheus-serve-addr says.
	fs := agentFlags(t, c.sidecar, map[string]string{"HOST_IP": "127.0.0.1"})
	_, port, err := net.SplitHostPort(flagString(t, fs, "prometheus-serve-addr"))
	must(t, err)
	metricsURL := "http://" + net.JoinHostPort(c.node.Addr4.String(), port) + "/metrics"
	if body, err := c.getFromNode(metricsURL, 5*time.Second); err != nil || !bytes.Contains(body, []byte("mtlsbridge_")) {
		t.Errorf("scraping %s: %v, %.200q", metricsURL, err, body)
	}

	// node-ingress on the uplink it found.
	waitFor(t, r, "node-ingress on "+netnstest.UplinkName, func() error {
		out, err := exec.Command(filepath.Join(c.bin, "mtlsbridge"), "db", "show", "attachments", "--state-dir="+r.stateDir).CombinedOutput()
		if err != nil || !regexp.MustCompile(`(?m)^`+netnstest.UplinkName+`\s+\d+\s+node-ingress\s+-\s+Done`).Match(out) {
			return fmt.Errorf("attachments (%v):\n%s", err, out)
		}
		return nil
	})

	// Enrolled by the policy, with the identity from its CiliumEndpoint.
	out, err := exec.Command(filepath.Join(c.bin, "mtlsbridge"), "db", "show", "enrollments", "-o", "json", "--state-dir="+r.stateDir).CombinedOutput()
	must(t, err)
	if !bytes.Contains(out, []byte("policy:cnp/app/web-mtls")) || !bytes.Contains(out, []byte("spiffe://cluster.local/identity/4242")) {
		t.Errorf("enrollments:\n%s", out)
	}
	waitFor(t, r, "the ready annotation on app/web", c.webAnnotated)
	waitFor(t, r, "the taint to go from node-a", c.taintGone)

	// The mTLS agent's token reviewed, a certificate issued for the web
	// pod, verifying against the Secret's root.
	resp, err := c.caRequest(t, r)
	if err != nil {
		t.Fatalf("certificate for app/web: %v", err)
	}
	block, _ := pem.Decode([]byte(resp.CertChain[0]))
	leaf, err := x509.ParseCertificate(block.Bytes)
	must(t, err)
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(c.secret.Data[identity.CACertFile])
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: roots, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
		t.Errorf("the leaf does not verify against the Secret's root: %v", err)
	}

	// The CNI chain: the plugin installed, Cilium's conflist untouched
	// (its mtlsbridge-cni entry is already what the agent would write).
	if _, err := os.Stat(filepath.Join(r.cniBin, "mtlsbridge-cni")); err != nil {
		t.Errorf("the plugin was not installed: %v", err)
	}
	if got, err := os.ReadFile(filepath.Join(r.cniConf, "05-cilium.conflist")); err != nil || string(got) != shippedConflist(t, r.stateDir) {
		t.Errorf("the agent changed the conflist Cilium wrote (%v):\n%s", err, got)
	}

	// Refusals of the annotation's writes show in its table, not the log.
	if out, err := exec.Command(filepath.Join(c.bin, "mtlsbridge"), "db", "show", "ready-annotations", "--state-dir="+r.stateDir).CombinedOutput(); err != nil || forbiddenRE.Match(out) {
		t.Errorf("ready-annotations (%v):\n%s", err, out)
	}
	r.stop()
	for who, run := range map[string]*agentRun{"the agent": r, "the signer": c.signer} {
		if log := run.logText(); forbiddenRE.MatchString(log) {
			loc := forbiddenRE.FindStringIndex(log)
			t.Errorf("%s's log says forbidden: %s", who, log[max(0, loc[0]-300):min(len(log), loc[1]+300)])
		}
	}

	// What each used against what it was granted.
	used, refused, streamed := c.used(t)
	checkGrants(t, "the agent", used, refused, streamed, granted(c.role))
	used, refused, streamed = c.usedBy(t, signerUser)
	checkGrants(t, "the signer", used, refused, streamed,
		granted(typed[rbacv1.ClusterRole](t, find(t, readFile(t, "kubernetes/mtlsbridge-signer.yaml"), "ClusterRole", "mtlsbridge-signer"))))
}

// checkGrants compares what who used (from the audit log) with the grants
// of its ClusterRole: a lacking one and an unused one both fail.
func checkGrants(t *testing.T, who string, used, refused map[permission]int, streamed map[permission]bool, grants map[permission]bool) {
	t.Helper()
	var lacking, unused, explained []string
	for p := range used {
		if !grants[p] {
			lacking = append(lacking, p.String())
		}
	}
	for p := range refused {
		lacking = append(lacking, p.String()+" (refused)")
	}
	for p := range grants {
		switch {
		case used[p] > 0:
		case streamed[p]:
			// Kept for API servers that do not stream lists (WatchList
			// off): client-go's reflector lists there instead.
			explained = append(explained, p.String())
		default:
			unused = append(unused, p.String())
		}
	}
	sort.Strings(lacking)
	sort.Strings(unused)
	sort.Strings(explained)
	t.Logf("%s used: %v", who, used)
	if len(explained) > 0 {
		t.Logf("%s: granted, not used here because the API server streamed the initial lists (needed where it does not): %v", who, explained)
	}
	if len(lacking) > 0 {
		t.Errorf("%s needs permissions its ClusterRole lacks: %v", who, lacking)
	}
	if len(unused) > 0 {
		t.Errorf("the ClusterRole grants permissions %s never used: %v", who, unused)
	}
}

// sidecarConfig is the sidecar's identity, from the test's side.
func (c *cluster) sidecarConfig(t *testing.T) *rest.Config { return rest.CopyConfig(c.token) }

// setRules replaces the ClusterRole's rules with the shipped ones less the
// permissions in without.
func (c *cluster) setRules(t *testing.T, without ...permission) {
	t.Helper()
	drop := map[permission]bool{}
	for _, p := range without {
		drop[p] = true
	}
	var rules []rbacv1.PolicyRule
	for _, r := range c.role.Rules {
		for _, g := range r.APIGroups {
			for _, res := range r.Resources {
				for _, v := range r.Verbs {
					if !drop[permission{g, res, v}] {
						rules = append(rules, rbacv1.PolicyRule{APIGroups: []string{g}, Resources: []string{res}, Verbs: []string{v}})
					}
				}
			}
		}
	}
	// Background: this also runs in cleanups, after the test's context ends.
	ctx := context.Background()
	role, err := c.admin.RbacV1().ClusterRoles().Get(ctx, c.role.Name, metav1.GetOptions{})
	must(t, err)
	role.Rules = rules
	_, err = c.admin.RbacV1().ClusterRoles().Update(ctx, role, metav1.UpdateOptions{})
	must(t, err)
	// The authorizer follows RBAC objects through a watch: wait until the
	// sidecar's identity is refused each dropped permission, and granted
	// the others, before an agent runs.
	sidecar := kubernetes.NewForConfigOrDie(c.sidecarConfig(t))
	deadline := time.Now().Add(waitLimit)
	for p := range granted(c.role) {
		for {
			review, err := sidecar.AuthorizationV1().SelfSubjectAccessReviews().Create(ctx, &authzv1.SelfSubjectAccessReview{
				Spec: authzv1.SelfSubjectAccessReviewSpec{ResourceAttributes: &authzv1.ResourceAttributes{
					Group: p.group, Resource: p.resource, Verb: p.verb, Namespace: "app"}},
			}, metav1.CreateOptions{})
			must(t, err)
			if review.Status.Allowed != drop[p] {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("RBAC still says %v is allowed=%v", p, review.Status.Allowed)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
}

// logSays waits until the agent's log has every one of parts on one line.
func logSays(t *testing.T, r *agentRun, parts ...string) {
	t.Helper()
	waitFor(t, r, fmt.Sprintf("a log line with %q", parts), func() error {
		for _, line := range strings.Split(r.logText(), "\n") {
			ok := true
			for _, p := range parts {
				ok = ok && strings.Contains(line, p)
			}
			if ok {
				return nil
			}
		}
		return fmt.Errorf("no such line yet")
	})
}

// shellSays waits until the output of a shell command of the agent (what
// an operator runs: `mtlsbridge shell -- health`, `db/show TABLE`) has
// every one of parts.
func shellSays(t *testing.T, c *cluster, r *agentRun, command []string, parts ...string) {
	t.Helper()
	waitFor(t, r, fmt.Sprintf("%q in the output of %q", parts, command), func() error {
		args := append([]string{"shell", "--state-dir=" + r.stateDir, "--"}, command...)
		out, err := exec.Command(filepath.Join(c.bin, "mtlsbridge"), args...).CombinedOutput()
		if err != nil {
			return fmt.Errorf("%v: %s", err, out)
		}
		for _, p := range parts {
			if !strings.Contains(string(out), p) {
				return fmt.Errorf("not yet:\n%s", out)
			}
		}
		return nil
	})
}

// healthSays waits until `mtlsbridge health` (the readiness probe) prints
// every one of parts.
func healthSays(t *testing.T, c *cluster, r *agentRun, parts ...string) {
	t.Helper()
	waitFor(t, r, fmt.Sprintf("%q in mtlsbridge health", parts), func() error {
		out, _ := exec.Command(filepath.Join(c.bin, "mtlsbridge"), "health", "--state-dir="+r.stateDir).CombinedOutput()
		for _, p := range parts {
			if !strings.Contains(string(out), p) {
				return fmt.Errorf("not yet:\n%s", out)
			}
		}
		return nil
	})
}

// neverReady checks that the readiness probe fails now and still fails a
// while later (a working agent is ready within a second here).
func neverReady(t *testing.T, c *cluster, r *agentRun) {
	t.Helper()
	for range 2 {
		if err := c.probe(r, c.sidecar.ReadinessProbe); err == nil {
			out, _ := exec.Command(filepath.Join(c.bin, "mtlsbridge"), "health", "--state-dir="+r.stateDir).CombinedOutput()
			t.Errorf("the agent reports ready:\n%s", out)
			return
		}
		time.Sleep(5 * time.Second)
	}
}

// TestAgentNeedsEachGrant: without one of the permissions or capabilities
// the shipped deployment grants, the agent fails in a way an operator
// sees (its log names what it was refused; readiness fails where the
// agent cannot work at all).
func TestAgentNeedsEachGrant(t *testing.T) {
	c := newCluster(t)
	all := capsOf(c.sidecar)
	for _, tc := range []struct {
		name    string
		without []permission
		dropCap string
		check   func(t *testing.T, r *agentRun)
	}{
		{name: "patch pods", without: []permission{{"", "pods", "patch"}}, check: func(t *testing.T, r *agentRun) {
			// The annotation reconciler's row carries the refusal.
			shellSays(t, c, r, []string{"db/show", "ready-annotations"}, "app/web", "is forbidden", "cannot patch resource")
			if c.webAnnotated() == nil {
				t.Error("app/web annotated without the permission")
			}
		}},
		{name: "update nodes", without: []permission{{"", "nodes", "update"}}, check: func(t *testing.T, r *agentRun) {
			// The agent says it (log, readiness naming the taint) and
			// the API server's audit log shows the refused update.
			logSays(t, r, "keeps its readiness taint", "forbidden")
			healthSays(t, c, r, `"ready-taint"`, "forbidden")
			neverReady(t, c, r)
			waitFor(t, r, "a refused update of node-a in the audit log", func() error {
				if _, refused, _ := c.used(t); refused[permission{"", "nodes", "update"}] == 0 {
					return fmt.Errorf("not yet")
				}
				return nil
			})
			if c.taintGone() == nil {
				t.Error("taint removed without the permission")
			}
		}},
		{name: "create tokenreviews", without: []permission{{"authentication.k8s.io", "tokenreviews", "create"}}, check: func(t *testing.T, r *agentRun) {
			// Readiness names it before any mTLS agent tries.
			healthSays(t, c, r, `"token-review"`, "forbidden")
			neverReady(t, c, r)
			if _, err := c.caRequest(t, r); err == nil || !strings.Contains(err.Error(), "forbidden") {
				t.Errorf("certificate request without TokenReview: %v, want refused, naming forbidden", err)
			}
			logSays(t, r, "forbidden", "tokenreviews")
		}},
		{name: "list and watch endpointslices", without: []permission{{"discovery.k8s.io", "endpointslices", "list"}, {"discovery.k8s.io", "endpointslices", "watch"}}, check: func(t *testing.T, r *agentRun) {
			// The signer cannot be found: the mTLS agent is told so, and
			// readiness warns.
			waitFor(t, r, "the trust bundle", func() error {
				_, err := os.Stat(filepath.Join(r.stateDir, "ca", identity.RootCertFile))
				return err
			})
			if _, err := c.caRequest(t, r); err == nil || !strings.Contains(err.Error(), identity.ReasonUpstreamUnreachable) || !strings.Contains(err.Error(), "forbidden") {
				t.Errorf("certificate request without the signer's endpoints: %v, want refused as %s, naming forbidden", err, identity.ReasonUpstreamUnreachable)
			}
			healthSays(t, c, r, `"ca-upstream"`, "forbidden")
		}},
		{name: "watch ciliumendpoints", without: []permission{{"cilium.io", "ciliumendpoints", "watch"}, {"cilium.io", "ciliumendpoints", "list"}},
			check: func(t *testing.T, r *agentRun) {
				logSays(t, r, "forbidden", "ciliumendpoints")
				neverReady(t, c, r)
			}},
		{name: "capability BPF", dropCap: "BPF", check: func(t *testing.T, r *agentRun) {
			logSays(t, r, "operation not permitted")
			neverReady(t, c, r)
		}},
		{name: "capability NET_ADMIN", dropCap: "NET_ADMIN", check: func(t *testing.T, r *agentRun) {
			logSays(t, r, "operation not permitted")
			neverReady(t, c, r)
		}},
		{name: "capability PERFMON", dropCap: "PERFMON", check: func(t *testing.T, r *agentRun) {
			logSays(t, r, "permission denied")
			neverReady(t, c, r)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c.reset(t)
			c.setRules(t, tc.without...)
			t.Cleanup(func() { c.setRules(t) })
			caps := slices.DeleteFunc(slices.Clone(all), func(cp string) bool { return cp == tc.dropCap })
			if tc.dropCap != "" && len(caps) == len(all) {
				t.Fatalf("the sidecar does not add %s", tc.dropCap)
			}
			r := c.freshRun(t, caps)
			tc.check(t, r)
		})
	}
}

func capsOf(c *corev1.Container) []string {
	var caps []string
	for _, cp := range c.SecurityContext.Capabilities.Add {
		caps = append(caps, string(cp))
	}
	return caps
}
