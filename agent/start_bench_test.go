// SPDX-License-Identifier: Apache-2.0

package agent_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/mtlsbridge/mtlsbridge/api/client"
	"github.com/mtlsbridge/mtlsbridge/identity"
	"github.com/mtlsbridge/mtlsbridge/internal/gomodule"
	"github.com/mtlsbridge/mtlsbridge/internal/kubetest"
	"github.com/mtlsbridge/mtlsbridge/internal/syncbuf"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// The cluster of BenchmarkAgentStart: 100,000 pods on 1,000 nodes in 1,000
// namespaces (a quarter labelled for mTLS), 950 CNPs and 50 CCNPs that
// require authentication; the agent runs on node-1 (100 pods).
const (
	startPods       = 100_000
	startNodes      = 1_000
	startNamespaces = 1_000
	startCNPs       = 950
	startCCNPs      = 50
	startApps       = 10
	startWorkers    = 32
)

// BenchmarkAgentStart runs the agent binary against a real kube-apiserver
// that holds a 100,000-pod cluster and reports the time from its start to
// ready (/healthz 200: every table listed and derived), its peak RSS, and at
// rest (after the runtime's forced collection) its RSS and live Go heap (in
// all and per pod). Filling the API server takes minutes, once per run:
//
//	go test -run '^$' -bench BenchmarkAgentStart -benchtime 3x ./agent/
func BenchmarkAgentStart(b *testing.B) {
	cfg := kubetest.Start(b)
	kubetest.ApplyCiliumCRDs(b, cfg)
	fill := time.Now()
	fillCluster(b, cfg)
	b.Logf("API server filled in %s", time.Since(fill).Round(time.Second))
	// Ready needs CA material: the Secret a Helm install creates.
	certPEM, keyPEM, err := identity.NewRootMaterial("cluster.local", time.Hour)
	must(b, err)
	_, err = kubernetes.NewForConfigOrDie(cfg).CoreV1().Secrets("kube-system").Create(b.Context(), &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "mtlsbridge-ca", Namespace: "kube-system"},
		Data:       map[string][]byte{identity.CACertFile: certPEM, identity.CAKeyFile: keyPEM},
	}, metav1.CreateOptions{})
	must(b, err)
	bin := b.TempDir()
	gomodule.Build(b, bin, "mtlsbridge")
	kubeconfig := kubetest.WriteKubeconfig(b, cfg)

	var ready, rss, peakRSS, heap []float64
	for b.Loop() {
		f := startOnce(b, filepath.Join(bin, "mtlsbridge"), kubeconfig)
		ready, rss, peakRSS, heap = append(ready, f.ready.Seconds()), append(rss, f.rss), append(peakRSS, f.peakRSS), append(heap, f.heap)
	}
	b.ReportMetric(median(ready), "s-to-ready")
	b.ReportMetric(median(rss)/(1<<20), "MiB-RSS")
	b.ReportMetric(median(peakRSS)/(1<<20), "MiB-peak-RSS")
	b.ReportMetric(median(heap)/(1<<20), "MiB-heap")
	b.ReportMetric(median(heap)/startPods, "heap-B/pod")
}

// startOnce starts the agent, waits for it to be ready and to settle, and
// measures it.
func startOnce(b *testing.B, bin, kubeconfig string) startFigures {
	stateDir, err := os.MkdirTemp("", "mtlsbridge-")
	must(b, err)
	defer os.RemoveAll(stateDir)
	logs := &syncbuf.Buffer{}
	cmd := exec.Command(bin, "agent", "--source=k8s", "--kubeconfig="+kubeconfig, "--node-name=node-1",
		"--state-dir="+stateDir, "--grpc-listen=127.0.0.1:0", "--enable-redirect=false", "--kube-api-qps=50", "--kube-api-burst=100", "--pprof")
	cmd.Stdout, cmd.Stderr = logs, logs
	start := time.Now()
	must(b, cmd.Start())
	defer func() {
		cmd.Process.Kill()
		cmd.Wait()
	}()

	api := client.New(stateDir)
	deadline := start.Add(5 * time.Minute)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		resp, err := api.Do(ctx, http.MethodGet, "/healthz", "", nil)
		cancel()
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				break
			}
		}
		if time.Now().After(deadline) {
			b.Fatalf("agent not ready within 5 minutes; log tail:\n%s", tail(logs.String(), 40))
		}
		time.Sleep(20 * time.Millisecond)
	}
	toReady := time.Since(start)

	// At rest: what the agent holds once its start-up garbage is gone. An
	// idle Go program collects at the latest after two minutes (the
	// runtime's forced GC); before that RSS counts the garbage of the
	// initial lists too.
	time.Sleep(2*time.Minute + 10*time.Second)
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", cmd.Process.Pid))
	must(b, err)
	f := startFigures{ready: toReady,
		rss: procKiB(string(status), "VmRSS:") * 1024, peakRSS: procKiB(string(status), "VmHWM:") * 1024}
	// The live heap: a heap profile with gc=1 collects first, and the
	// runtime's metrics then say what the collection left.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	resp, err := api.Do(ctx, http.MethodGet, "/debug/pprof/heap?gc=1", "", nil)
	must(b, err)
	if resp.StatusCode != http.StatusOK {
		b.Fatalf("heap profile: %s", resp.Status)
	}
	profile, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	must(b, err)
	if path := os.Getenv(heapProfileEnv); path != "" {
		must(b, os.WriteFile(path, profile, 0o644))
	}
	resp, err = api.Do(ctx, http.MethodGet, "/metrics", "", nil)
	must(b, err)
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "go_memstats_heap_alloc_bytes "); ok {
			f.heap, _ = strconv.ParseFloat(v, 64)
		}
	}
	return f
}

// heapProfileEnv names a file for the agent's heap profile at rest (of the
// last start): go tool pprof -sample_index=inuse_space FILE.
const heapProfileEnv = "MTLSBRIDGE_BENCH_HEAP_PROFILE"

// startFigures are what one start of the agent measured.
type startFigures struct {
	ready              time.Duration
	rss, peakRSS, heap float64 // bytes
}

// fillCluster creates the benchmark's namespaces, policies and running pods.
func fillCluster(b *testing.B, cfg *rest.Config) {
	fast := rest.CopyConfig(cfg)
	fast.QPS, fast.Burst = 5000, 5000
	kube := kubernetes.NewForConfigOrDie(fast)
	dyn := dynamic.NewForConfigOrDie(fast)
	ctx := b.Context()
	parallel(b, startNamespaces, func(i int) error {
		ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("ns-%d", i)}}
		if i%4 == 0 {
			ns.Labels = map[string]string{tables.NamespaceEnabledLabel: "true"}
		}
		_, err := kube.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{})
		return err
	})
	parallel(b, startCNPs+startCCNPs, func(i int) error {
		app := fmt.Sprintf("app-%d", i%startApps)
		ingress := []any{map[string]any{"authentication": map[string]any{"mode": "required"}}}
		if i < startCNPs {
			_, err := dyn.Resource(kubetest.CNPResource).Namespace(fmt.Sprintf("ns-%d", i)).Create(ctx, &unstructured.Unstructured{Object: map[string]any{
				"apiVersion": "cilium.io/v2", "kind": "CiliumNetworkPolicy",
				"metadata": map[string]any{"name": fmt.Sprintf("cnp-%d", i)},
				"spec":     map[string]any{"endpointSelector": map[string]any{"matchLabels": map[string]any{"app": app}}, "ingress": ingress},
			}}, metav1.CreateOptions{})
			return err
		}
		_, err := dyn.Resource(kubetest.CCNPResource).Create(ctx, &unstructured.Unstructured{Object: map[string]any{
			"apiVersion": "cilium.io/v2", "kind": "CiliumClusterwideNetworkPolicy",
			"metadata": map[string]any{"name": fmt.Sprintf("ccnp-%d", i)},
			"spec": map[string]any{"endpointSelector": map[string]any{"matchLabels": map[string]any{
				"app": app, "k8s:io.kubernetes.pod.namespace": fmt.Sprintf("ns-%d", i)}}, "ingress": ingress},
		}}, metav1.CreateOptions{})
		return err
	})
	parallel(b, startPods, func(i int) error {
		ns := fmt.Sprintf("ns-%d", i%startNamespaces)
		app := fmt.Sprintf("app-%d", (i/startNamespaces)%startApps)
		pod, err := kube.CoreV1().Pods(ns).Create(ctx, &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("pod-%d", i), Labels: map[string]string{
				"app": app, "tier": []string{"front", "back"}[i%2], "pod-template-hash": fmt.Sprintf("%08x", i/7)}},
			Spec: corev1.PodSpec{NodeName: fmt.Sprintf("node-%d", i%startNodes), ServiceAccountName: "sa-" + app,
				Containers: []corev1.Container{{Name: "main", Image: "registry.invalid/none"}}},
		}, metav1.CreateOptions{})
		if err != nil {
			return err
		}
		ip := fmt.Sprintf("10.%d.%d.%d", i>>16, (i>>8)&0xff, i&0xff)
		pod.Status = corev1.PodStatus{Phase: corev1.PodRunning, PodIP: ip, PodIPs: []corev1.PodIP{{IP: ip}}}
		_, err = kube.CoreV1().Pods(ns).UpdateStatus(ctx, pod, metav1.UpdateOptions{})
		return err
	})
}

// parallel runs create(0..n-1) on startWorkers goroutines and fails the
// benchmark on the first error.
func parallel(b *testing.B, n int, create func(i int) error) {
	var (
		wg    sync.WaitGroup
		once  sync.Once
		first error
		next  = make(chan int)
	)
	for range startWorkers {
		wg.Go(func() {
			for i := range next {
				if err := create(i); err != nil {
					once.Do(func() { first = fmt.Errorf("object %d: %w", i, err) })
				}
			}
		})
	}
	for i := 0; i < n && first == nil; i++ {
		next <- i
	}
	close(next)
	wg.Wait()
	if first != nil {
		b.Fatal(first)
	}
}

func procKiB(status, field string) float64 {
	for line := range strings.Lines(status) {
		if v, ok := strings.CutPrefix(line, field); ok {
			n, _ := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 64)
			return n
		}
	}
	return 0
}

func median(v []float64) float64 {
	s := append([]float64(nil), v...)
	slices.Sort(s)
	return s[len(s)/2]
}

func tail(s string, lines int) string {
	all := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(all[max(0, len(all)-lines):], "\n")
}
