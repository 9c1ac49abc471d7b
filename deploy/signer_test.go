// SPDX-License-Identifier: Apache-2.0

package deploy_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	authnv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/mtlsbridge/mtlsbridge/internal/kubetest"
)

// TestSignerDeployment runs the signer as deploy/kubernetes/mtlsbridge-signer.yaml
// deploys it: its container's args, the CA Secret as the kubelet mounts it,
// and the credentials of its ServiceAccount, which only the manifest's
// ClusterRole grants anything. It becomes ready (every table read, the CA
// material loaded, token reviews working) without a "forbidden" in its
// log. (TestAgentLeastPrivilege has the sidecar's certificate signed by it.)
func TestSignerDeployment(t *testing.T) {
	cfg := kubetest.Start(t)
	kubetest.ApplyCiliumCRDs(t, cfg)
	admin := kubernetes.NewForConfigOrDie(cfg)
	const manifest = "kubernetes/mtlsbridge-signer.yaml"
	installShipped(t, cfg, admin, manifest)
	deployment := typed[appsv1.Deployment](t, find(t, readFile(t, manifest), "Deployment", "mtlsbridge-signer"))

	tr, err := admin.CoreV1().ServiceAccounts(ciliumNS).CreateToken(t.Context(), deployment.Spec.Template.Spec.ServiceAccountName,
		&authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{ExpirationSeconds: new(int64(3600))}}, metav1.CreateOptions{})
	must(t, err)
	kubeconfig := sidecarKubeconfig(t, &rest.Config{BearerToken: tr.Status.Token, TLSClientConfig: rest.TLSClientConfig{CAData: cfg.CAData}}, cfg.Host)

	// Paths are the test's; listeners stay on loopback.
	stateDir := filepath.Join(t.TempDir(), "state")
	secret, _ := createCAObjects(t, "cluster.local")
	args := signerArgs(t, deployment, map[string]string{
		"--state-dir":             stateDir,
		"--ca-dir":                writeSecretDir(t, secret),
		"--grpc-listen":           "127.0.0.1:0",
		"--prometheus-serve-addr": "127.0.0.1:0",
		"--health-serve-addr":     "127.0.0.1:0",
	})
	bin := filepath.Join(buildAgent(t), "mtlsbridge")
	logPath := filepath.Join(t.TempDir(), "signer.log")
	logFile, err := os.Create(logPath)
	must(t, err)
	cmd := exec.Command(bin, append(args, "--kubeconfig="+kubeconfig)...)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	must(t, cmd.Start())
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGTERM)
		cmd.Wait()
		logFile.Close()
	})

	deadline := time.Now().Add(time.Minute)
	for {
		out, err := exec.Command(bin, "health", "--state-dir="+stateDir).CombinedOutput()
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			log, _ := os.ReadFile(logPath)
			t.Fatalf("the signer is not ready: %v\n%s\nlog:\n%s", err, out, log)
		}
		time.Sleep(250 * time.Millisecond)
	}
	if log, _ := os.ReadFile(logPath); forbiddenRE.Match(log) {
		t.Errorf("the signer's log says forbidden:\n%s", log)
	}
}
