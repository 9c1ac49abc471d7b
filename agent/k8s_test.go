// SPDX-License-Identifier: Apache-2.0

package agent_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/mtlsbridge/mtlsbridge/agent"
	"github.com/mtlsbridge/mtlsbridge/grpcserver"
	"github.com/mtlsbridge/mtlsbridge/internal/kubetest"
	"github.com/mtlsbridge/mtlsbridge/internal/syncbuf"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/enrollment"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// TestKubernetesSource runs the agent against a real kube-apiserver and etcd
// and checks that the enrollments table follows pods, namespaces, policies
// and endpoints as they are created, changed and deleted.
func TestKubernetesSource(t *testing.T) {
	cfg := kubetest.Start(t)
	kubetest.ApplyCiliumCRDs(t, cfg)
	ctx := t.Context()
	kube := kubernetes.NewForConfigOrDie(cfg)
	dyn := dynamic.NewForConfigOrDie(cfg)

	// Objects that exist before the agent starts arrive with the first listing.
	createNamespace(t, kube, "app", nil)
	kubetest.CreatePod(t, kube, "app", "web", "node-a", map[string]string{"app": "web"}, netip.MustParseAddr("10.0.1.1"))
	kubetest.CreatePod(t, kube, "app", "api", "node-b", map[string]string{"app": "api"}, netip.MustParseAddr("10.0.2.1"))
	kubetest.CreatePod(t, kube, "kube-system", "ztunnel", "node-a", map[string]string{"cilium.io/redir-type": "proxy"}, netip.MustParseAddr("10.0.1.2"))
	// The same label where --mtls-agent-namespaces does not trust it.
	kubetest.CreatePod(t, kube, "app", "self-made-agent", "node-a", map[string]string{"cilium.io/redir-type": "proxy"}, netip.MustParseAddr("10.0.1.3"))

	a := startAgent(t, cfg)
	db, enrollments, policies := a.db, a.enrollments, a.policies
	wait := func(what string, cond func(txn statedb.ReadTxn) bool) {
		t.Helper()
		deadline := time.After(30 * time.Second)
		for {
			txn := db.ReadTxn()
			_, watchE := enrollments.AllWatch(txn)
			_, watchP := policies.AllWatch(txn)
			initialized, watchInit := enrollments.Initialized(txn)
			if initialized {
				watchInit = nil // closed once initialized: do not spin on it
			}
			if cond(txn) {
				return
			}
			select {
			case <-watchInit:
			case <-watchE:
			case <-watchP:
			case <-deadline:
				t.Fatalf("timed out waiting for %s; enrollments:\n%s\npending initializers: %v", what, dumpEnrollments(txn, enrollments), pendingInitializers(db))
			}
		}
	}
	reason := func(txn statedb.ReadTxn, key string) string {
		e, _, found := enrollments.Get(txn, enrollment.ByKey(key))
		if !found {
			return "<none>"
		}
		return e.Reason
	}

	// Step 1: the first listing. The table is initialized only after it.
	// api, on another node and not enrolled, has no row on this one.
	wait("initial enrollments", func(txn statedb.ReadTxn) bool {
		ok, _ := enrollments.Initialized(txn)
		return ok && reason(txn, "app/web") == enrollment.ReasonNotSelected &&
			reason(txn, "app/api") == "<none>" &&
			reason(txn, "kube-system/ztunnel") == enrollment.ReasonMTLSAgent &&
			reason(txn, "app/self-made-agent") == enrollment.ReasonNotSelected
	})

	// Step 2: a CNP requiring authentication enrolls web; its endpoint gives
	// the Cilium identity.
	createObject(t, dyn, kubetest.CNPResource, "app", map[string]any{
		"apiVersion": "cilium.io/v2", "kind": "CiliumNetworkPolicy",
		"metadata": map[string]any{"name": "web-mtls", "namespace": "app"},
		"spec": map[string]any{
			"endpointSelector": map[string]any{"matchLabels": map[string]any{"k8s:app": "web"}},
			"ingress":          []any{map[string]any{"authentication": map[string]any{"mode": "required"}}},
		},
	})
	createObject(t, dyn, kubetest.CEPResource, "app", map[string]any{
		"apiVersion": "cilium.io/v2", "kind": "CiliumEndpoint",
		"metadata": map[string]any{"name": "web", "namespace": "app"},
		"status":   map[string]any{"identity": map[string]any{"id": int64(31337)}},
	})
	wait("web enrolled by the CNP with its identity", func(txn statedb.ReadTxn) bool {
		e, _, ok := enrollments.Get(txn, enrollment.ByKey("app/web"))
		return ok && e.Reason == "policy:cnp/app/web-mtls" &&
			e.IdentitySpiffeID == "spiffe://cluster.local/identity/31337" &&
			e.SpiffeID == "spiffe://cluster.local/ns/app/sa/default"
	})

	// Step 3: labelling the namespace enrolls api; relabelling web to opt
	// out does not cancel the policy that requires authentication: the row
	// notes the ignored label.
	ns, err := kube.CoreV1().Namespaces().Get(ctx, "app", metav1.GetOptions{})
	must(t, err)
	ns.Labels = map[string]string{"io.cilium/mtls-enabled": "true"}
	_, err = kube.CoreV1().Namespaces().Update(ctx, ns, metav1.UpdateOptions{})
	must(t, err)
	web, err := kube.CoreV1().Pods("app").Get(ctx, "web", metav1.GetOptions{})
	must(t, err)
	web.Labels["cilium.io/redir-type"] = "none"
	_, err = kube.CoreV1().Pods("app").Update(ctx, web, metav1.UpdateOptions{})
	must(t, err)
	wait("api by namespace label, web's opt-out ignored", func(txn statedb.ReadTxn) bool {
		e, _, _ := enrollments.Get(txn, enrollment.ByKey("app/web"))
		return reason(txn, "app/api") == enrollment.ReasonNamespaceLabel &&
			e != nil && e.Reason == "policy:cnp/app/web-mtls" && e.IgnoredOptOut
	})

	// Step 4: a CCNP scoped to the namespace takes over api; a policy that
	// Cilium's schema admits but whose selector is invalid (In without
	// values) is recorded with its error and enrolls nothing.
	createObject(t, dyn, kubetest.CCNPResource, "", map[string]any{
		"apiVersion": "cilium.io/v2", "kind": "CiliumClusterwideNetworkPolicy",
		"metadata": map[string]any{"name": "app-api"},
		"spec": map[string]any{
			"endpointSelector": map[string]any{"matchLabels": map[string]any{
				"k8s:io.kubernetes.pod.namespace": "app", "app": "api"}},
			"egress": []any{map[string]any{"authentication": map[string]any{"mode": "required"}}},
		},
	})
	createObject(t, dyn, kubetest.CNPResource, "app", map[string]any{
		"apiVersion": "cilium.io/v2", "kind": "CiliumNetworkPolicy",
		"metadata": map[string]any{"name": "bad-selector", "namespace": "app"},
		"spec": map[string]any{
			"endpointSelector": map[string]any{"matchExpressions": []any{map[string]any{"key": "app", "operator": "In"}}},
			"ingress":          []any{map[string]any{"authentication": map[string]any{"mode": "required"}}},
		},
	})
	wait("api enrolled by the CCNP, bad policy recorded", func(txn statedb.ReadTxn) bool {
		p, _, ok := policies.Get(txn, tables.PolicyByKey("cnp/app/bad-selector"))
		return reason(txn, "app/api") == "policy:ccnp/app-api" && ok &&
			p.Error == `spec.endpointSelector: values: Invalid value: null: for 'in', 'notin' operators, values set can't be empty`
	})

	// Step 5: deletes. The CCNP goes (api falls back to the namespace label),
	// then the pod goes (its row goes).
	must(t, dyn.Resource(kubetest.CCNPResource).Delete(ctx, "app-api", metav1.DeleteOptions{}))
	wait("api back to the namespace label", func(txn statedb.ReadTxn) bool {
		return reason(txn, "app/api") == enrollment.ReasonNamespaceLabel
	})
	must(t, kube.CoreV1().Pods("app").Delete(ctx, "api", metav1.DeleteOptions{GracePeriodSeconds: new(int64)}))
	wait("api's row removed", func(txn statedb.ReadTxn) bool {
		return reason(txn, "app/api") == "<none>"
	})
}

// k8sAgent is an agent running against the test's API server.
type k8sAgent struct {
	db          *statedb.DB
	enrollments statedb.Table[*enrollment.Enrollment]
	policies    statedb.Table[*tables.Policy]
	pods        statedb.Table[*tables.Pod]
	grpc        *grpcserver.Server
	stateDir    string
}

func startAgent(t *testing.T, cfg *rest.Config, extraFlags ...string) *k8sAgent {
	return startAgentLogging(t, cfg, hivetest.Logger(t), extraFlags...)
}

// startAgentLogging is startAgent logging to log.
func startAgentLogging(t *testing.T, cfg *rest.Config, log *slog.Logger, extraFlags ...string) *k8sAgent {
	return startHive(t, cfg, log, agent.Cell, append([]string{"--node-name=node-a", "--enable-redirect=false"}, extraFlags...)...)
}

// startHive runs cells against the test's API server, with a state folder
// of their own and the gRPC listener on a free loopback port.
func startHive(t *testing.T, cfg *rest.Config, log *slog.Logger, cells cell.Cell, extraFlags ...string) *k8sAgent {
	kubeconfig := kubetest.WriteKubeconfig(t, cfg)
	stateDir, err := os.MkdirTemp("", "mtlsbridge-")
	must(t, err)
	t.Cleanup(func() { os.RemoveAll(stateDir) })

	a := &k8sAgent{stateDir: stateDir}
	h := hive.New(agent.Infrastructure, cells,
		cell.Invoke(func(d *statedb.DB, e statedb.Table[*enrollment.Enrollment], p statedb.Table[*tables.Policy],
			pods statedb.Table[*tables.Pod], s *grpcserver.Server) {
			a.db, a.enrollments, a.policies, a.pods, a.grpc = d, e, p, pods, s
		}))
	flags := pflag.NewFlagSet("", pflag.ContinueOnError)
	h.RegisterFlags(flags)
	must(t, flags.Parse(append([]string{"--source=k8s", "--kubeconfig=" + kubeconfig, "--state-dir=" + stateDir, "--grpc-listen=127.0.0.1:0"}, extraFlags...)))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	must(t, h.Start(log, ctx))
	t.Cleanup(func() { h.Stop(log, context.Background()) })
	return a
}

func createNamespace(t *testing.T, kube kubernetes.Interface, name string, labels map[string]string) {
	_, err := kube.CoreV1().Namespaces().Create(t.Context(),
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}}, metav1.CreateOptions{})
	must(t, err)
}

func createObject(t *testing.T, dyn dynamic.Interface, gvr schema.GroupVersionResource, ns string, obj map[string]any) {
	var err error
	u := &unstructured.Unstructured{Object: obj}
	if ns == "" {
		_, err = dyn.Resource(gvr).Create(t.Context(), u, metav1.CreateOptions{})
	} else {
		_, err = dyn.Resource(gvr).Namespace(ns).Create(t.Context(), u, metav1.CreateOptions{})
	}
	must(t, err)
}

func dumpEnrollments(txn statedb.ReadTxn, tbl statedb.Table[*enrollment.Enrollment]) string {
	out := ""
	for e := range tbl.All(txn) {
		out += fmt.Sprintf("  %v\n", e.TableRow())
	}
	return out
}

func pendingInitializers(db *statedb.DB) map[string][]string {
	txn := db.ReadTxn()
	out := map[string][]string{}
	for _, t := range db.GetTables(txn) {
		if p := t.PendingInitializers(txn); len(p) > 0 {
			out[t.Name()] = p
		}
	}
	return out
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// After a kube-apiserver restart (an upgrade of the control plane) the
// watches resume within seconds, and the agent says when it lost them and
// when they came back (it took 55 to 96 s, silently, with client-go's
// default backoff).
func TestWatchesResumeAfterAPIServerRestart(t *testing.T) {
	srv := kubetest.StartServer(t, kubetest.Options{})
	kubetest.ApplyCiliumCRDs(t, srv.Config)
	kube := kubernetes.NewForConfigOrDie(srv.Config)
	createNamespace(t, kube, "app", map[string]string{"io.cilium/mtls-enabled": "true"})
	logs := &syncbuf.Buffer{}
	a := startAgentLogging(t, srv.Config, slog.New(slog.NewTextHandler(logs, nil)))
	waitPod := func(key string, within time.Duration) {
		t.Helper()
		deadline := time.Now().Add(within)
		for {
			if _, _, ok := a.pods.Get(a.db.ReadTxn(), tables.PodByKey(key)); ok {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("pod %s not in the agent's table within %s:\n%s", key, within, logs.String())
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	kubetest.CreateRunningPod(t, kube, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "before", Namespace: "app"},
		Spec: corev1.PodSpec{NodeName: "node-a"}}, "10.0.1.1")
	waitPod("app/before", 30*time.Second)

	// Down for 12 s: client-go's default backoff would then wait 13 to
	// 26 s more after the server is back.
	srv.Restart(t, 12*time.Second)
	kubetest.CreateRunningPod(t, kube, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "after", Namespace: "app"},
		Spec: corev1.PodSpec{NodeName: "node-a"}}, "10.0.1.2")
	// A bound on the fault's cost, not a speed target: retries come every
	// 3 to 4.5 s at most.
	waitPod("app/after", 10*time.Second)
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(logs.String(), "Kubernetes watch resumed") {
		if time.Now().After(deadline) {
			t.Fatalf("no log line of the resumption:\n%s", logs.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	if !strings.Contains(logs.String(), "Kubernetes watch lost") {
		t.Errorf("no log line of the loss:\n%s", logs.String())
	}
}
