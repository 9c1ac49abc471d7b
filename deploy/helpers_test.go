// SPDX-License-Identifier: Apache-2.0

package deploy_test

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"net/netip"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/spf13/pflag"
	"helm.sh/helm/v4/pkg/action"
	"helm.sh/helm/v4/pkg/chart/common"
	"helm.sh/helm/v4/pkg/chart/loader"
	releasev1 "helm.sh/helm/v4/pkg/release/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"

	"github.com/mtlsbridge/mtlsbridge/agent"
	"github.com/mtlsbridge/mtlsbridge/internal/kubetest"
)

const (
	// The values of each mode: l2 (the default) and in-pod.
	l2Values    = "l2/cilium-values.yaml"
	inpodValues = "inpod/cilium-values.yaml"
	// Each mode's mTLS agent.
	l2Agent    = "l2/mtlsbridge-proxy.yaml"
	inpodAgent = "inpod/ztunnel.yaml"
	// What both modes apply.
	manifestsDir  = "kubernetes"
	ciliumNS      = "kube-system"
	sidecarName   = "mtlsbridge"
	ciliumAccount = "cilium"
)

// renderCilium renders Cilium's chart (kubetest.CiliumChart) with shipped
// values (l2Values or inpodValues), as `helm upgrade cilium cilium/cilium
// -f deploy/FILE` would, through Helm's Go SDK: client-only, for the
// Kubernetes version the tests' API server runs. Schema validation of the
// values (the chart's values.schema.json) is on.
func renderCilium(t *testing.T, valuesFile string) []*unstructured.Unstructured {
	t.Helper()
	chrt, err := loader.Load(kubetest.CiliumChart(t))
	must(t, err)
	vals, err := common.ReadValuesFile(valuesFile)
	must(t, err)
	install := action.NewInstall(&action.Configuration{})
	install.DryRunStrategy = action.DryRunClient
	install.Replace = true // no release store to look names up in
	install.ReleaseName = "cilium"
	install.Namespace = ciliumNS
	kv, err := common.ParseKubeVersion(kubetest.KubernetesVersion)
	must(t, err)
	install.KubeVersion = kv
	rel, err := install.RunWithContext(t.Context(), chrt, vals)
	if err != nil {
		t.Fatalf("rendering Cilium's chart with %s: %v", valuesFile, err)
	}
	r, ok := rel.(*releasev1.Release)
	if !ok {
		t.Fatalf("helm returned a %T, want a v1 release", rel)
	}
	objs, err := parseYAML([]byte(r.Manifest))
	must(t, err)
	return objs
}

// shippedValues is what the tests read of a values file: the sidecar,
// its volumes, and every other value.
type shippedValues struct {
	ExtraContainers []corev1.Container `json:"extraContainers"`
	ExtraVolumes    []corev1.Volume    `json:"extraVolumes"`
	Rest            map[string]any     `json:"-"`
}

func readValues(t *testing.T, file string) shippedValues {
	t.Helper()
	data, err := os.ReadFile(file)
	must(t, err)
	var v shippedValues
	must(t, yaml.Unmarshal(data, &v))
	must(t, yaml.Unmarshal(data, &v.Rest))
	delete(v.Rest, "extraContainers")
	delete(v.Rest, "extraVolumes")
	if len(v.ExtraContainers) != 1 {
		t.Fatalf("%s: %d extraContainers, want the sidecar alone", file, len(v.ExtraContainers))
	}
	return v
}

// projectedToken is the audience of the ServiceAccount token container c
// finds at file through the pod's volumes, or "" if none is projected there.
func projectedToken(volumes []corev1.Volume, c *corev1.Container, file string) (audience string) {
	for _, m := range c.VolumeMounts {
		if v := volumeNamed(volumes, m.Name); v != nil && v.Projected != nil && m.MountPath == path.Dir(file) {
			for _, src := range v.Projected.Sources {
				if sa := src.ServiceAccountToken; sa != nil && sa.Path == path.Base(file) {
					return sa.Audience
				}
			}
		}
	}
	return ""
}

// readManifests parses every YAML file of deploy/kubernetes.
func readManifests(t *testing.T) []*unstructured.Unstructured {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(manifestsDir, "*.yaml"))
	must(t, err)
	if len(files) == 0 {
		t.Fatalf("no manifests in %s", manifestsDir)
	}
	sort.Strings(files)
	var objs []*unstructured.Unstructured
	for _, f := range files {
		objs = append(objs, readFile(t, f)...)
	}
	return objs
}

func readFile(t *testing.T, path string) []*unstructured.Unstructured {
	t.Helper()
	data, err := os.ReadFile(path)
	must(t, err)
	objs, err := parseYAML(data)
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return objs
}

// parseYAML splits a multi-document YAML stream into objects, skipping
// empty documents.
func parseYAML(data []byte) ([]*unstructured.Unstructured, error) {
	reader := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	var objs []*unstructured.Unstructured
	for {
		doc, err := reader.Read()
		if errors.Is(err, io.EOF) {
			return objs, nil
		}
		if err != nil {
			return nil, err
		}
		var fields map[string]any
		if err := yaml.Unmarshal(doc, &fields); err != nil {
			return nil, err
		}
		if len(fields) == 0 {
			continue
		}
		objs = append(objs, &unstructured.Unstructured{Object: fields})
	}
}

// find returns the object of that kind and name, or fails the test.
func find(t *testing.T, objs []*unstructured.Unstructured, kind, name string) *unstructured.Unstructured {
	t.Helper()
	for _, o := range objs {
		if o.GetKind() == kind && o.GetName() == name {
			return o
		}
	}
	t.Fatalf("no %s %s among %d objects", kind, name, len(objs))
	return nil
}

// typed converts an object to its Go type.
func typed[T any](t *testing.T, u *unstructured.Unstructured) *T {
	t.Helper()
	var out T
	if err := runtime.DefaultUnstructuredConverter.FromUnstructuredWithValidation(u.Object, &out, true); err != nil {
		t.Fatalf("%s %s: %v", u.GetKind(), u.GetName(), err)
	}
	return &out
}

// ciliumDaemonSet is the rendered Cilium DaemonSet and its mtlsbridge
// container.
func ciliumDaemonSet(t *testing.T, objs []*unstructured.Unstructured) (*appsv1.DaemonSet, *corev1.Container) {
	t.Helper()
	ds := typed[appsv1.DaemonSet](t, find(t, objs, "DaemonSet", "cilium"))
	for i := range ds.Spec.Template.Spec.Containers {
		if c := &ds.Spec.Template.Spec.Containers[i]; c.Name == sidecarName {
			return ds, c
		}
	}
	t.Fatalf("the rendered Cilium DaemonSet has no %s container", sidecarName)
	return nil, nil
}

// onHost is what a path inside container c is on the node, through its
// mounts of volumes: a host path, "volume:NAME" for a volume of another
// kind, or "container:PATH" when no mount holds it.
func onHost(c *corev1.Container, volumes []corev1.Volume, p string) string {
	for _, m := range c.VolumeMounts {
		rel, err := filepath.Rel(m.MountPath, p)
		if err != nil || strings.HasPrefix(rel, "..") {
			continue
		}
		if v := volumeNamed(volumes, m.Name); v != nil && v.HostPath != nil {
			return path.Join(v.HostPath.Path, rel)
		}
		return "volume:" + m.Name
	}
	return "container:" + p
}

var envRef = regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_]*)\)`)

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

// agentFlags parses the sidecar's args (after "agent") with the agent's
// own flag set, so that a misspelt or removed flag fails here rather than
// in a cluster. $(VAR) references are expanded as the kubelet does, with
// vars.
func agentFlags(t *testing.T, c *corev1.Container, vars map[string]string) *pflag.FlagSet {
	t.Helper()
	return commandFlags(t, c, "agent", agent.Cell, vars)
}

// signerFlags parses the signer container's args as agentFlags does.
func signerFlags(t *testing.T, c *corev1.Container) *pflag.FlagSet {
	t.Helper()
	return commandFlags(t, c, "signer", agent.SignerCell, nil)
}

func commandFlags(t *testing.T, c *corev1.Container, command string, cells cell.Cell, vars map[string]string) *pflag.FlagSet {
	t.Helper()
	if len(c.Args) == 0 || c.Args[0] != command {
		t.Fatalf("container %s: args %q do not start with the %s command", c.Name, c.Args, command)
	}
	args := make([]string, 0, len(c.Args)-1)
	for _, a := range c.Args[1:] {
		args = append(args, envRef.ReplaceAllStringFunc(a, func(ref string) string {
			name := envRef.FindStringSubmatch(ref)[1]
			v, ok := vars[name]
			if !ok {
				t.Fatalf("container %s: arg %q refers to $(%s), which the test does not set", c.Name, a, name)
			}
			return v
		}))
	}
	fs := pflag.NewFlagSet(command, pflag.ContinueOnError)
	hive.New(agent.Infrastructure, cells).RegisterFlags(fs)
	fs.Bool("debug", false, "") // added by cmd/mtlsbridge beside the hive's
	if err := fs.Parse(args); err != nil {
		t.Fatalf("container %s: %s refuses its args: %v", c.Name, command, err)
	}
	return fs
}

func flagString(t *testing.T, fs *pflag.FlagSet, name string) string {
	t.Helper()
	f := fs.Lookup(name)
	if f == nil {
		t.Fatalf("the agent has no flag --%s", name)
	}
	if sv, ok := f.Value.(pflag.SliceValue); ok {
		return strings.Join(sv.GetSlice(), ",")
	}
	return f.Value.String()
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
