// Package kubetest runs a real kube-apiserver, backed by its own etcd, for
// integration tests.
//
// The two binaries are built from Go modules by hack/kube-assets.sh (make
// kube-assets) into a folder named for their versions. Start finds them there,
// runs both processes on 127.0.0.1 only, in a temporary folder, and stops them
// when the test ends. There is no controller-manager, scheduler or kubelet:
// objects are stored and served, and nothing acts on them. Pods stay Pending,
// deleted namespaces stay Terminating, and no service account is created for
// a namespace (so the ServiceAccount admission plugin is turned off, and pods
// can be created without one).
//
// Each call to Start runs a server of its own, ready in a few seconds and
// using about 320 MB of memory.
package kubetest

import (
	"bufio"
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/yaml"
)

const (
	// KubernetesVersion and EtcdVersion are the versions that
	// hack/kube-assets.sh builds; they name the default assets folder.
	KubernetesVersion = "v1.37.2"
	EtcdVersion       = "v3.7.3"

	// AssetsEnv names the environment variable that overrides the folder
	// holding the kube-apiserver and etcd binaries.
	AssetsEnv = "MTLSBRIDGE_KUBE_ASSETS"

	// RequireEnv names the environment variable that, set to 1, turns missing
	// binaries into a test failure instead of a skip.
	RequireEnv = "MTLSBRIDGE_REQUIRE_PRIVILEGED"
)

const (
	startTimeout = 60 * time.Second // etcd and kube-apiserver each
	crdTimeout   = 30 * time.Second // for each CRD to become Established
	stopTimeout  = 10 * time.Second // from SIGTERM to SIGKILL
	logTailLines = 40
	adminUser    = "kubetest-admin"
	pollInterval = 100 * time.Millisecond
)

var crdGVR = schema.GroupVersionResource{
	Group:    "apiextensions.k8s.io",
	Version:  "v1",
	Resource: "customresourcedefinitions",
}

// AssetsDir returns the folder that holds the kube-apiserver and etcd
// binaries: $MTLSBRIDGE_KUBE_ASSETS, or the folder hack/kube-assets.sh fills
// by default.
func AssetsDir() (string, error) {
	if dir := os.Getenv(AssetsEnv); dir != "" {
		return dir, nil
	}
	home, err := os.UserHomeDir()
	if err != nil {
		return "", fmt.Errorf("kubetest: finding the default assets folder: %w (set %s)", err, AssetsEnv)
	}
	return filepath.Join(home, ".cache", "mtlsbridge", "kube-"+KubernetesVersion+"-etcd-"+EtcdVersion), nil
}

// Start runs etcd and kube-apiserver for the test and returns a config for a
// client that is a cluster admin (group system:masters). Both processes are
// stopped and their files removed when the test ends.
//
// If the binaries are missing, Start skips the test with a message saying
// how to build them, or fails it when MTLSBRIDGE_REQUIRE_PRIVILEGED=1.
func Start(t testing.TB) *rest.Config {
	t.Helper()
	return StartServer(t, Options{}).Config
}

// Options change how StartServer runs kube-apiserver.
type Options struct {
	// AuditPolicy, when set, is an audit.k8s.io/v1 Policy (YAML): the server
	// writes the events it selects to Server.AuditLog, one JSON object a
	// line, before it answers each request (the log backend's blocking mode),
	// so that a request answered is a request logged.
	AuditPolicy string
}

// Server is a running kube-apiserver.
type Server struct {
	// Config is a cluster admin's (group system:masters).
	Config *rest.Config
	// AuditLog is the audit log file, empty without Options.AuditPolicy.
	AuditLog string

	bin, logPath string
	args         []string
	apiserver    *process
}

// Restart kills kube-apiserver, waits down, and starts it again on the same
// port with the same state (etcd keeps running), as a crash or an upgrade
// of the control plane does. It returns once the server is ready again.
func (s *Server) Restart(t testing.TB, down time.Duration) {
	t.Helper()
	s.Kill()
	time.Sleep(down)
	s.StartAgain(t)
}

// Kill kills kube-apiserver (etcd keeps running); StartAgain brings it
// back.
func (s *Server) Kill() { s.apiserver.kill() }

// StartAgain starts the killed kube-apiserver on the same port with the
// same state, and returns once it is ready.
func (s *Server) StartAgain(t testing.TB) {
	t.Helper()
	s.apiserver = startProcess(t, "kube-apiserver", s.bin, s.logPath, s.args...)
	if err := waitFor(s.apiserver, startTimeout, func() (bool, error) { return readyz(s.Config) }); err != nil {
		t.Fatalf("kubetest: kube-apiserver not ready after a restart: %v\n%s", err, s.apiserver.logTail())
	}
}

// StartServer is Start with options.
func StartServer(t testing.TB, opts Options) *Server {
	t.Helper()

	etcdBin, apiserverBin := findBinaries(t)
	dir := t.TempDir()

	etcdURL := startEtcd(t, etcdBin, dir)

	token, err := randomHex(32)
	if err != nil {
		t.Fatalf("kubetest: %v", err)
	}
	port, err := freePort()
	if err != nil {
		t.Fatalf("kubetest: %v", err)
	}
	certDir := filepath.Join(dir, "certs")
	saKey := filepath.Join(dir, "service-account.key")
	tokens := filepath.Join(dir, "tokens.csv")
	if err := writeServiceAccountKey(saKey); err != nil {
		t.Fatalf("kubetest: %v", err)
	}
	// token,user,uid,"group,..."
	line := fmt.Sprintf("%s,%s,%s,\"system:masters\"\n", token, adminUser, adminUser)
	if err := os.WriteFile(tokens, []byte(line), 0o600); err != nil {
		t.Fatalf("kubetest: %v", err)
	}

	srv := &Server{}
	args := []string{
		"--etcd-servers=" + etcdURL,
		"--bind-address=127.0.0.1",
		// Advertise loopback too, rather than an address of the host's
		// default route (which a sandbox may not have).
		"--advertise-address=127.0.0.1",
		"--secure-port=" + strconv.Itoa(port),
		"--cert-dir=" + certDir,
		"--service-cluster-ip-range=10.0.0.0/24",
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file=" + saKey,
		"--service-account-signing-key-file=" + saKey,
		"--token-auth-file=" + tokens,
		"--authorization-mode=RBAC",
		// The default reconciler refuses a loopback advertise address.
		"--endpoint-reconciler-type=none",
		// No controller-manager creates the default service accounts.
		"--disable-admission-plugins=ServiceAccount",
		// As on every cluster Cilium runs on: its DaemonSet has a privileged
		// init container (mount-bpf-fs).
		"--allow-privileged=true",
	}
	if opts.AuditPolicy != "" {
		policy := filepath.Join(dir, "audit-policy.yaml")
		if err := os.WriteFile(policy, []byte(opts.AuditPolicy), 0o600); err != nil {
			t.Fatalf("kubetest: %v", err)
		}
		srv.AuditLog = filepath.Join(dir, "audit.log")
		args = append(args,
			"--audit-policy-file="+policy,
			"--audit-log-path="+srv.AuditLog,
			"--audit-log-format=json",
			"--audit-log-mode=blocking",
		)
	}
	srv.bin, srv.logPath, srv.args = apiserverBin, filepath.Join(dir, "kube-apiserver.log"), args
	apiserver := startProcess(t, "kube-apiserver", apiserverBin, srv.logPath, args...)
	srv.apiserver = apiserver

	host := "https://" + net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	certFile := filepath.Join(certDir, "apiserver.crt")
	var cfg *rest.Config
	err = waitFor(apiserver, startTimeout, func() (bool, error) {
		// The apiserver writes its self-signed certificate on start up.
		ca, err := os.ReadFile(certFile)
		if err != nil {
			return false, err
		}
		cfg = &rest.Config{
			Host:            host,
			BearerToken:     token,
			TLSClientConfig: rest.TLSClientConfig{CAData: ca},
			// Tests make bursts of calls; the default 5 QPS slows them down.
			QPS:   100,
			Burst: 200,
		}
		return readyz(cfg)
	})
	if err != nil {
		t.Fatalf("kubetest: kube-apiserver at %s is not ready: %v\n%s", host, err, apiserver.logTail())
	}
	srv.Config = cfg
	return srv
}

// ApplyCRDs applies every *.yaml file in dir, each holding one or more
// apiextensions.k8s.io/v1 CustomResourceDefinitions, with server-side apply,
// and waits until each one is Established. Applying the same files again
// changes nothing.
func ApplyCRDs(t testing.TB, cfg *rest.Config, dir string) {
	t.Helper()

	files, err := filepath.Glob(filepath.Join(dir, "*.yaml"))
	if err != nil {
		t.Fatalf("kubetest: %v", err)
	}
	if len(files) == 0 {
		t.Fatalf("kubetest: no *.yaml files in %s", dir)
	}
	// Cilium's schemas use the "idn-hostname" format, which the API server
	// does not know and warns about on every apply: noise, not news.
	quiet := rest.CopyConfig(cfg)
	quiet.WarningHandler = rest.NoWarnings{}
	client, err := dynamic.NewForConfig(quiet)
	if err != nil {
		t.Fatalf("kubetest: %v", err)
	}
	crds := client.Resource(crdGVR)

	var names []string
	for _, file := range files {
		objs, err := readCRDs(file)
		if err != nil {
			t.Fatalf("kubetest: %v", err)
		}
		for _, obj := range objs {
			_, err := crds.Apply(t.Context(), obj.GetName(), obj, metav1.ApplyOptions{FieldManager: "kubetest", Force: true})
			if err != nil {
				t.Fatalf("kubetest: applying CRD %s from %s: %v", obj.GetName(), file, err)
			}
			names = append(names, obj.GetName())
		}
	}

	for _, name := range names {
		if err := waitEstablished(t.Context(), crds, name); err != nil {
			t.Fatalf("kubetest: %v", err)
		}
	}
}

// readCRDs parses the YAML documents of file, which must all be
// CustomResourceDefinitions.
func readCRDs(file string) ([]*unstructured.Unstructured, error) {
	data, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	reader := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	var objs []*unstructured.Unstructured
	for {
		doc, err := reader.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("reading %s: %w", file, err)
		}
		var fields map[string]any
		if err := yaml.Unmarshal(doc, &fields); err != nil {
			return nil, fmt.Errorf("parsing %s: %w", file, err)
		}
		if len(fields) == 0 {
			continue // an empty document, or only comments
		}
		obj := &unstructured.Unstructured{Object: fields}
		gvk := obj.GroupVersionKind()
		if gvk.Group != crdGVR.Group || gvk.Version != crdGVR.Version || gvk.Kind != "CustomResourceDefinition" {
			return nil, fmt.Errorf("%s: want apiextensions.k8s.io/v1 CustomResourceDefinition, got %s %s",
				file, obj.GetAPIVersion(), obj.GetKind())
		}
		if obj.GetName() == "" {
			return nil, fmt.Errorf("%s: a CustomResourceDefinition has no metadata.name", file)
		}
		objs = append(objs, obj)
	}
	if len(objs) == 0 {
		return nil, fmt.Errorf("%s holds no CustomResourceDefinition", file)
	}
	return objs, nil
}

// waitEstablished waits until the CRD's Established condition is True.
func waitEstablished(ctx context.Context, crds dynamic.ResourceInterface, name string) error {
	ctx, cancel := context.WithTimeout(ctx, crdTimeout)
	defer cancel()
	last := "not read yet"
	for {
		obj, err := crds.Get(ctx, name, metav1.GetOptions{})
		switch {
		case err == nil:
			established, message := condition(obj, "Established")
			if established {
				return nil
			}
			last = "Established is not True: " + message
			if _, msg := condition(obj, "NamesAccepted"); msg != "" {
				last += "; NamesAccepted: " + msg
			}
		case apierrors.IsNotFound(err):
			last = err.Error()
		case ctx.Err() == nil:
			last = err.Error()
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("CRD %s is not Established after %s: %s", name, crdTimeout, last)
		case <-time.After(pollInterval):
		}
	}
}

// condition reports whether the status condition of type typ is True, with
// its message.
func condition(obj *unstructured.Unstructured, typ string) (bool, string) {
	conds, _, _ := unstructured.NestedSlice(obj.Object, "status", "conditions")
	for _, c := range conds {
		m, ok := c.(map[string]any)
		if !ok || m["type"] != typ {
			continue
		}
		msg, _ := m["message"].(string)
		return m["status"] == "True", msg
	}
	return false, ""
}

func findBinaries(t testing.TB) (etcd, apiserver string) {
	t.Helper()
	dir, err := AssetsDir()
	if err == nil {
		etcd = filepath.Join(dir, "etcd")
		apiserver = filepath.Join(dir, "kube-apiserver")
		err = errors.Join(checkExecutable(etcd), checkExecutable(apiserver))
	}
	if err == nil {
		return etcd, apiserver
	}
	reason := strings.ReplaceAll(err.Error(), "\n", "; ")
	msg := fmt.Sprintf("kubetest: the kube-apiserver and etcd binaries are missing (%s); "+
		"run `make kube-assets` (hack/kube-assets.sh) to build them, or set %s to their folder", reason, AssetsEnv)
	if os.Getenv(RequireEnv) == "1" {
		t.Fatal(msg + " (failing, not skipping, because " + RequireEnv + "=1)")
	}
	t.Skip(msg)
	return "", ""
}

func checkExecutable(path string) error {
	info, err := os.Stat(path)
	if err != nil {
		return err
	}
	if info.IsDir() || info.Mode().Perm()&0o111 == 0 {
		return fmt.Errorf("%s is not an executable file", path)
	}
	return nil
}

// startEtcd runs a single-member etcd with its data in dir and returns its
// client URL once it reports healthy. Its ports were free a moment before
// it binds them: when another process took one meanwhile (tests of other
// packages run alongside), it starts again on new ports.
func startEtcd(t testing.TB, bin, dir string) string {
	t.Helper()
	const attempts = 3
	for attempt := 1; ; attempt++ {
		clientURL, etcd, err := tryEtcd(t, bin, filepath.Join(dir, fmt.Sprintf("etcd-%d", attempt)))
		if err == nil {
			return clientURL
		}
		tail := etcd.logTail()
		if attempt < attempts && strings.Contains(tail, "address already in use") {
			t.Logf("kubetest: etcd lost its port to another process (%v); starting it again", err)
			continue
		}
		t.Fatalf("kubetest: etcd at %s is not healthy: %v\n%s", clientURL, err, tail)
	}
}

// tryEtcd starts etcd on two ports free a moment ago and waits until it
// reports healthy.
func tryEtcd(t testing.TB, bin, dir string) (string, *process, error) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatalf("kubetest: %v", err)
	}
	clientPort, err := freePort()
	if err != nil {
		t.Fatalf("kubetest: %v", err)
	}
	peerPort, err := freePort()
	if err != nil {
		t.Fatalf("kubetest: %v", err)
	}
	clientURL := "http://" + net.JoinHostPort("127.0.0.1", strconv.Itoa(clientPort))
	peerURL := "http://" + net.JoinHostPort("127.0.0.1", strconv.Itoa(peerPort))

	etcd := startProcess(t, "etcd", bin, filepath.Join(dir, "etcd.log"),
		"--name=kubetest",
		"--data-dir="+filepath.Join(dir, "data"),
		"--listen-client-urls="+clientURL,
		"--advertise-client-urls="+clientURL,
		"--listen-peer-urls="+peerURL,
		"--initial-advertise-peer-urls="+peerURL,
		"--initial-cluster=kubetest="+peerURL,
		"--unsafe-no-fsync",
	)

	httpClient := &http.Client{Timeout: time.Second}
	err = waitFor(etcd, startTimeout, func() (bool, error) {
		resp, err := httpClient.Get(clientURL + "/health")
		if err != nil {
			return false, err
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		if resp.StatusCode != http.StatusOK || !bytes.Contains(body, []byte(`"health":"true"`)) {
			return false, fmt.Errorf("/health: %s: %s", resp.Status, bytes.TrimSpace(body))
		}
		return true, nil
	})
	return clientURL, etcd, err
}

// process is a child process whose output goes to a log file.
type process struct {
	name    string
	logPath string
	done    chan struct{} // closed when the process has exited
	err     error         // how it exited, once done is closed
	// tailShown is set once a failure message has included the log tail,
	// so that the cleanup does not log it again.
	tailShown bool
	// kill stops the process with SIGKILL and waits for it.
	kill func()
}

// startProcess starts bin and registers a cleanup that stops it: SIGTERM,
// then SIGKILL after stopTimeout. On a failed test the cleanup logs the
// process's last lines of output.
func startProcess(t testing.TB, name, bin, logPath string, args ...string) *process {
	t.Helper()
	logFile, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644) // a restart appends
	if err != nil {
		t.Fatalf("kubetest: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Stdout = logFile
	cmd.Stderr = logFile
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = stopTimeout
	setDeathSignal(cmd)
	if err := cmd.Start(); err != nil {
		cancel()
		logFile.Close()
		t.Fatalf("kubetest: starting %s: %v", name, err)
	}
	p := &process{name: name, logPath: logPath, done: make(chan struct{})}
	p.kill = func() { cmd.Process.Kill(); <-p.done }
	go func() {
		p.err = cmd.Wait()
		logFile.Close()
		close(p.done)
	}()
	t.Cleanup(func() {
		cancel()
		<-p.done
		if t.Failed() && !p.tailShown {
			t.Logf("kubetest: %s", p.logTail())
		}
	})
	return p
}

// logTail returns the last lines of the process's output, with a heading.
func (p *process) logTail() string {
	p.tailShown = true
	data, err := os.ReadFile(p.logPath)
	if err != nil {
		return fmt.Sprintf("(cannot read the %s log: %v)", p.name, err)
	}
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	if len(lines) > logTailLines {
		lines = lines[len(lines)-logTailLines:]
	}
	return fmt.Sprintf("last lines of the %s log (%s):\n%s", p.name, p.logPath, strings.Join(lines, "\n"))
}

// waitFor calls ready every pollInterval until it reports true, the process
// exits, or timeout passes. An error from ready is not final: it is the
// reason given if the wait fails.
func waitFor(p *process, timeout time.Duration, ready func() (bool, error)) error {
	deadline := time.Now().Add(timeout)
	var last error
	for {
		ok, err := ready()
		if ok {
			return nil
		}
		if err != nil {
			last = err
		}
		select {
		case <-p.done:
			return fmt.Errorf("%s exited: %v", p.name, p.err)
		case <-time.After(pollInterval):
		}
		if time.Now().After(deadline) {
			if last != nil {
				return fmt.Errorf("%s not ready after %s; last: %w", p.name, timeout, last)
			}
			return fmt.Errorf("%s not ready after %s", p.name, timeout)
		}
	}
}

// readyz reports whether the apiserver's /readyz answers ok, and if not,
// why.
func readyz(cfg *rest.Config) (bool, error) {
	httpClient, err := rest.HTTPClientFor(cfg)
	if err != nil {
		return false, err
	}
	httpClient.Timeout = 2 * time.Second
	defer httpClient.CloseIdleConnections()
	resp, err := httpClient.Get(cfg.Host + "/readyz")
	if err != nil {
		return false, err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if resp.StatusCode != http.StatusOK {
		return false, fmt.Errorf("/readyz: %s: %s", resp.Status, bytes.TrimSpace(body))
	}
	return true, nil
}

// freePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("finding a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// writeServiceAccountKey writes a new P-256 private key, which the apiserver
// uses both to sign service account tokens and to verify them.
func writeServiceAccountKey(path string) error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return fmt.Errorf("making the service account key: %w", err)
	}
	// SEC1, not PKCS#8: --service-account-key-file finds public keys in
	// "EC PRIVATE KEY" blocks but not in "PRIVATE KEY" ones.
	der, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return fmt.Errorf("encoding the service account key: %w", err)
	}
	return os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der}), 0o600)
}

func randomHex(n int) (string, error) {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		return "", fmt.Errorf("making a token: %w", err)
	}
	return hex.EncodeToString(b), nil
}
