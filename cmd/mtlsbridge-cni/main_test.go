// SPDX-License-Identifier: Apache-2.0

package main_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"

	"github.com/mtlsbridge/mtlsbridge/cni/install"
	"github.com/mtlsbridge/mtlsbridge/cni/plugin"
	"github.com/mtlsbridge/mtlsbridge/internal/agenttest"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/enrollment"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// pluginBin is the plugin, built once for the package's tests.
var pluginBin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "mtlsbridge-cni-")
	if err != nil {
		panic(err)
	}
	pluginBin = filepath.Join(dir, "mtlsbridge-cni")
	gobin := filepath.Join(runtime.GOROOT(), "bin", "go")
	if out, err := exec.Command(gobin, "build", "-o", pluginBin, ".").CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "go build: %v\n%s", err, out)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// prevResult is what Cilium returns for a pod (CNI 1.0.0).
const prevResult = `{
  "cniVersion": "1.0.0",
  "interfaces": [{"name": "eth0", "mac": "0a:58:0a:00:01:14", "sandbox": "/var/run/netns/cni-1234"}],
  "ips": [
    {"address": "10.0.1.20/32", "gateway": "10.0.1.1", "interface": 0},
    {"address": "fd00:1::20/128", "interface": 0}
  ],
  "routes": [{"dst": "0.0.0.0/0", "gw": "10.0.1.1"}],
  "dns": {}
}`

// conf is the plugin's entry as the runtime passes it, with prevResult.
func conf(stateDir string, extra string) string {
	return fmt.Sprintf(`{"cniVersion": "1.0.0", "name": "cilium", "type": "mtlsbridge-cni",
  "stateDir": %q, "excludedNamespaces": ["kube-system"], "waitTimeout": "1s"%s,
  "prevResult": %s}`, stateDir, extra, prevResult)
}

type result struct {
	code           int
	stdout, stderr string
	took           time.Duration
}

// cniError is the error JSON of the CNI spec.
type cniError struct {
	CNIVersion string `json:"cniVersion"`
	Code       uint   `json:"code"`
	Msg        string `json:"msg"`
	Details    string `json:"details"`
}

func (r result) err(t *testing.T) cniError {
	t.Helper()
	if r.code == 0 {
		t.Fatalf("exit 0, want an error; stdout:\n%s", r.stdout)
	}
	var e cniError
	if err := json.Unmarshal([]byte(r.stdout), &e); err != nil || e.Msg == "" {
		t.Fatalf("stdout is not CNI error JSON (%v):\n%s\nstderr: %s", err, r.stdout, r.stderr)
	}
	return e
}

// run executes the plugin as a runtime does: CNI_* variables, the
// configuration on stdin.
func run(t *testing.T, command, ns, pod, stdin string, env ...string) result {
	t.Helper()
	cmd := exec.Command(pluginBin)
	cmd.Env = []string{"CNI_COMMAND=" + command, "CNI_CONTAINERID=c-" + pod, "CNI_NETNS=/var/run/netns/cni-1234",
		"CNI_IFNAME=eth0", "CNI_PATH=/opt/cni/bin",
		"CNI_ARGS=IgnoreUnknown=1;K8S_POD_NAMESPACE=" + ns + ";K8S_POD_NAME=" + pod + ";K8S_POD_INFRA_CONTAINER_ID=c-" + pod}
	cmd.Env = append(cmd.Env, env...)
	cmd.Stdin = strings.NewReader(stdin)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	start := time.Now()
	err := cmd.Run()
	r := result{stdout: stdout.String(), stderr: stderr.String(), took: time.Since(start)}
	if ee, ok := err.(*exec.ExitError); ok {
		r.code = ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	return r
}

// jsonEqual compares two JSON documents by value.
func jsonEqual(t *testing.T, got, want string) {
	t.Helper()
	var g, w any
	if err := json.Unmarshal([]byte(got), &g); err != nil {
		t.Fatalf("output is not JSON (%v):\n%s", err, got)
	}
	json.Unmarshal([]byte(want), &w)
	gb, _ := json.Marshal(g)
	wb, _ := json.Marshal(w)
	if !bytes.Equal(gb, wb) {
		t.Fatalf("output differs from prevResult:\n got %s\nwant %s", gb, wb)
	}
}

// startAgent runs a whole agent on the manifests of testdata.
func startAgent(t *testing.T) (*agenttest.Agent, statedb.Table[*tables.CNIPod], statedb.Table[*enrollment.Enrollment]) {
	manifests := t.TempDir()
	b, err := os.ReadFile("testdata/cluster.yaml")
	if err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(manifests, "cluster.yaml"), b, 0o644)
	var pods statedb.Table[*tables.CNIPod]
	var enrollments statedb.Table[*enrollment.Enrollment]
	a := agenttest.Start(t, manifests, []cell.Cell{cell.Invoke(func(p statedb.Table[*tables.CNIPod], e statedb.Table[*enrollment.Enrollment]) {
		pods, enrollments = p, e
	})})
	return a, pods, enrollments
}

func TestVersion(t *testing.T) {
	r := run(t, "VERSION", "", "", `{"cniVersion": "1.0.0"}`)
	if r.code != 0 {
		t.Fatalf("exit %d: %s %s", r.code, r.stdout, r.stderr)
	}
	var v struct {
		CNIVersion        string   `json:"cniVersion"`
		SupportedVersions []string `json:"supportedVersions"`
	}
	if err := json.Unmarshal([]byte(r.stdout), &v); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"0.3.1", "0.4.0", "1.0.0", "1.1.0"} {
		if !strings.Contains(strings.Join(v.SupportedVersions, ","), want) {
			t.Errorf("supportedVersions %v lacks %s", v.SupportedVersions, want)
		}
	}
}

// TestAgainstAgent runs the plugin against a whole agent (manifest folder,
// no datapath: --enable-redirect=false, so no enrolled pod ever becomes
// ready).
func TestAgainstAgent(t *testing.T) {
	a, cniPods, enrollments := startAgent(t)

	t.Run("not enrolled: prevResult passed through", func(t *testing.T) {
		r := run(t, "ADD", "app", "plain", conf(a.StateDir, ""))
		if r.code != 0 {
			t.Fatalf("exit %d:\n%s\n%s", r.code, r.stdout, r.stderr)
		}
		jsonEqual(t, r.stdout, prevResult)
		row, _, ok := cniPods.Get(a.DB.ReadTxn(), tables.CNIPodByContainer("c-plain"))
		if !ok || row.Pod != "app/plain" || row.State != tables.CNIStateAllowed || row.Reason != enrollment.ReasonNotSelected ||
			fmt.Sprint(row.IPs) != "[10.0.1.20 fd00:1::20]" || row.Netns != "/var/run/netns/cni-1234" {
			t.Fatalf("cni-pods row: %+v", row)
		}
	})

	// The heart of the no-IP problem: the enrollments table says
	// excluded:no-ip (the API has no address yet), the plugin's answer is
	// enrolled, decided with the addresses of prevResult.
	for _, tc := range []struct{ ns, pod, reason string }{
		{"app", "web", enrollment.ReasonWorkloadLabel},
		{"mesh", "api", enrollment.ReasonNamespaceLabel},
	} {
		t.Run("enrolled, redirect never ready: "+tc.pod, func(t *testing.T) {
			e, _, _ := enrollments.Get(a.DB.ReadTxn(), enrollment.ByKey(tc.ns+"/"+tc.pod))
			if e == nil || e.Reason != enrollment.ReasonNoIP {
				t.Fatalf("enrollments row: %+v, want %s", e, enrollment.ReasonNoIP)
			}
			r := run(t, "ADD", tc.ns, tc.pod, conf(a.StateDir, ""))
			e2 := r.err(t)
			if e2.Code != 11 || !strings.Contains(e2.Msg, "not in place") || !strings.Contains(e2.Details, tc.reason) ||
				!strings.Contains(e2.Details, "pending") {
				t.Fatalf("error: %+v", e2)
			}
			if r.took < time.Second || r.took > 8*time.Second {
				t.Fatalf("took %s, want about the 1s wait", r.took)
			}
			row, _, ok := cniPods.Get(a.DB.ReadTxn(), tables.CNIPodByContainer("c-"+tc.pod))
			if !ok || !row.Enrolled || row.State != tables.CNIStateWaiting || row.Redirect != "pending" {
				t.Fatalf("cni-pods row: %+v", row)
			}
			// The reported addresses count from now on: the enrollments
			// table follows, and the report is kept in the state folder.
			e, _, _ = enrollments.Get(a.DB.ReadTxn(), enrollment.ByKey(tc.ns+"/"+tc.pod))
			if e == nil || !e.Enrolled || e.Reason != tc.reason {
				t.Fatalf("enrollments row after the report: %+v, want enrolled by %s", e, tc.reason)
			}
			if _, err := os.Stat(filepath.Join(a.StateDir, "cni-pods", "c-"+tc.pod+".json")); err != nil {
				t.Fatal(err)
			}
		})
	}

	t.Run("pod unknown to the agent", func(t *testing.T) {
		e := run(t, "ADD", "app", "ghost", conf(a.StateDir, "")).err(t)
		if e.Code != 11 || !strings.Contains(e.Msg, "not known") {
			t.Fatalf("error: %+v", e)
		}
	})

	t.Run("CHECK", func(t *testing.T) {
		if r := run(t, "CHECK", "app", "plain", conf(a.StateDir, "")); r.code != 0 || r.stdout != "" {
			t.Fatalf("not enrolled: exit %d: %s %s", r.code, r.stdout, r.stderr)
		}
		before, _, _ := cniPods.Get(a.DB.ReadTxn(), tables.CNIPodByContainer("c-web"))
		if e := run(t, "CHECK", "app", "web", conf(a.StateDir, "")).err(t); e.Code != 11 {
			t.Fatalf("enrolled, not redirected: %+v", e)
		}
		// The same question and answer again rewrite nothing.
		if after, _, _ := cniPods.Get(a.DB.ReadTxn(), tables.CNIPodByContainer("c-web")); after != before {
			t.Fatalf("CHECK rewrote the row of c-web: %+v -> %+v", before, after)
		}
		// CHECK exists from CNI 0.4.0 on.
		old := strings.Replace(conf(a.StateDir, ""), `"cniVersion": "1.0.0", "name"`, `"cniVersion": "0.3.1", "name"`, 1)
		if e := run(t, "CHECK", "app", "plain", old).err(t); e.Code != 1 {
			t.Fatalf("CHECK with 0.3.1: %+v", e)
		}
	})

	t.Run("rows of pods deleted from the API go", func(t *testing.T) {
		if _, _, ok := cniPods.Get(a.DB.ReadTxn(), tables.CNIPodByContainer("c-web")); !ok {
			t.Fatal("no row for c-web")
		}
		b, _ := os.ReadFile("testdata/cluster.yaml")
		docs := strings.Split(string(b), "---\n")
		docs = slices.DeleteFunc(docs, func(d string) bool { return strings.Contains(d, "name: web,") })
		a.WriteManifest(t, "cluster.yaml", strings.Join(docs, "---\n"))
		deadline := time.Now().Add(10 * time.Second)
		for {
			if _, _, ok := cniPods.Get(a.DB.ReadTxn(), tables.CNIPodByContainer("c-web")); !ok {
				break
			}
			if time.Now().After(deadline) {
				t.Fatal("row of the deleted pod still there")
			}
			time.Sleep(20 * time.Millisecond)
		}
		if _, _, ok := cniPods.Get(a.DB.ReadTxn(), tables.CNIPodByContainer("c-api")); !ok {
			t.Fatal("row of another pod went too")
		}
	})

	t.Run("DEL forgets the container and prints nothing", func(t *testing.T) {
		r := run(t, "DEL", "app", "plain", conf(a.StateDir, ""))
		if r.code != 0 || r.stdout != "" {
			t.Fatalf("exit %d: %q %q", r.code, r.stdout, r.stderr)
		}
		if _, _, ok := cniPods.Get(a.DB.ReadTxn(), tables.CNIPodByContainer("c-plain")); ok {
			t.Fatal("cni-pods row still there after DEL")
		}
		if _, err := os.Stat(filepath.Join(a.StateDir, "cni-pods", "c-plain.json")); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("the state folder keeps c-plain after DEL: %v", err)
		}
	})

	t.Run("metrics: every answer, by kind", func(t *testing.T) {
		families, err := a.Metrics.Gather()
		if err != nil {
			t.Fatal(err)
		}
		counts := map[string]uint64{}
		for _, f := range families {
			if f.GetName() != "mtlsbridge_cni_answer_seconds" {
				continue
			}
			for _, m := range f.GetMetric() {
				counts[m.GetLabel()[0].GetValue()] = m.GetHistogram().GetSampleCount()
			}
		}
		// ADD and CHECK of plain; ADD of web and api, CHECK of web; ADD
		// of ghost.
		if counts["not-needed"] < 2 || counts["pending"] < 3 || counts["unknown"] < 1 {
			t.Fatalf("answers counted %v", counts)
		}
	})
}

func TestAgentUnreachable(t *testing.T) {
	noAgent := t.TempDir() // no api.sock

	t.Run("fail closed", func(t *testing.T) {
		e := run(t, "ADD", "app", "web", conf(noAgent, "")).err(t)
		if e.Code != 11 || !strings.Contains(e.Msg, "unreachable") || !strings.Contains(e.Details, "app/web") {
			t.Fatalf("error: %+v", e)
		}
	})
	t.Run("fail open: starts, loudly", func(t *testing.T) {
		r := run(t, "ADD", "app", "web", conf(noAgent, `, "failPolicy": "open"`))
		if r.code != 0 {
			t.Fatalf("exit %d: %s %s", r.code, r.stdout, r.stderr)
		}
		jsonEqual(t, r.stdout, prevResult)
		if !strings.Contains(r.stderr, "FAIL-OPEN") || !strings.Contains(r.stderr, "app/web") {
			t.Fatalf("stderr not loud: %q", r.stderr)
		}
	})
	t.Run("excluded namespace starts", func(t *testing.T) {
		r := run(t, "ADD", "kube-system", "coredns", conf(noAgent, ""))
		if r.code != 0 {
			t.Fatalf("exit %d: %s %s", r.code, r.stdout, r.stderr)
		}
		jsonEqual(t, r.stdout, prevResult)
	})
	t.Run("DEL succeeds", func(t *testing.T) {
		if r := run(t, "DEL", "app", "web", conf(noAgent, "")); r.code != 0 || r.stdout != "" {
			t.Fatalf("exit %d: %q %q", r.code, r.stdout, r.stderr)
		}
	})
}

func TestBadInput(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		name, command, stdin string
		env                  []string
		code                 uint
		msg                  string
	}{
		{"malformed JSON", "ADD", `{"cniVersion": "1.0.0", "prevResult": `, nil, 6, ""},
		{"not JSON at all", "ADD", `hello`, nil, 6, ""},
		{"no prevResult", "ADD", `{"cniVersion": "1.0.0", "name": "n", "type": "mtlsbridge-cni"}`, nil, 7, "no prevResult"},
		{"bad failPolicy", "ADD", conf(dir, `, "failPolicy": "maybe"`), nil, 7, "invalid failPolicy"},
		{"bad waitTimeout", "ADD", strings.Replace(conf(dir, ""), `"1s"`, `"soon"`, 1), nil, 7, "invalid waitTimeout"},
		{"bad prevResult", "ADD", strings.Replace(conf(dir, ""), `"10.0.1.20/32"`, `"not-an-ip"`, 1), nil, 6, "prevResult"},
		{"unsupported version", "ADD", strings.Replace(conf(dir, ""), `"1.0.0", "name"`, `"9.9.9", "name"`, 1), nil, 1, ""},
		{"no pod identity", "ADD", conf(dir, ""), []string{"CNI_ARGS=IgnoreUnknown=1"}, 4, "no pod identity"},
		{"no container id", "ADD", conf(dir, ""), []string{"CNI_CONTAINERID="}, 4, ""},
		{"no command", "", conf(dir, ""), []string{"CNI_COMMAND=BOGUS"}, 4, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := run(t, tc.command, "app", "web", tc.stdin, tc.env...).err(t)
			if e.Code != tc.code || !strings.Contains(e.Msg, tc.msg) {
				t.Fatalf("got %+v, want code %d msg ~%q", e, tc.code, tc.msg)
			}
		})
	}

	// DEL never fails, whatever it is given.
	for name, stdin := range map[string]string{"garbage": "{{{", "empty": "", "bad version": `{"cniVersion": "9.9.9"}`} {
		t.Run("DEL "+name, func(t *testing.T) {
			for _, env := range [][]string{nil, {"CNI_CONTAINERID=", "CNI_ARGS=", "CNI_IFNAME="}} {
				if r := run(t, "DEL", "app", "web", stdin, env...); r.code != 0 || r.stdout != "" {
					t.Fatalf("exit %d: %q %q", r.code, r.stdout, r.stderr)
				}
			}
		})
	}
}

// TestVersions: a conflist of an older CNI version gets its prevResult back
// in that version.
func TestVersions(t *testing.T) {
	old := `{"cniVersion": "0.4.0", "name": "cilium", "type": "mtlsbridge-cni", "stateDir": "/nonexistent",
  "excludedNamespaces": ["kube-system"],
  "prevResult": {"cniVersion": "0.4.0", "interfaces": [{"name": "eth0"}],
    "ips": [{"version": "4", "address": "10.0.1.20/32", "interface": 0}]}}`
	r := run(t, "ADD", "kube-system", "coredns", old)
	if r.code != 0 {
		t.Fatalf("exit %d: %s %s", r.code, r.stdout, r.stderr)
	}
	jsonEqual(t, r.stdout, `{"cniVersion": "0.4.0", "interfaces": [{"name": "eth0"}],
    "ips": [{"version": "4", "address": "10.0.1.20/32", "interface": 0}]}`)
}

// TestUninstall: "mtlsbridge-cni uninstall" is the explicit removal step.
func TestUninstall(t *testing.T) {
	confDir, binDir := t.TempDir(), t.TempDir()
	conflist := filepath.Join(confDir, install.PreferredConflist)
	os.WriteFile(conflist, []byte(`{"cniVersion": "0.3.1", "name": "cilium", "plugins": [{"type": "cilium-cni"}]}`), 0o644)
	if _, err := install.InsertEntry(conflist, plugin.Entry("/var/run/mtlsbridge", plugin.FailClosed, nil, time.Second)); err != nil {
		t.Fatal(err)
	}
	if _, err := install.CopyBinary(pluginBin, binDir); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(pluginBin, "uninstall", "--cni-conf-dir="+confDir, "--cni-bin-dir="+binDir).CombinedOutput()
	if err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if ok, _ := install.HasEntry(conflist); ok {
		t.Fatal("entry still in the conflist")
	}
	if _, err := os.Stat(filepath.Join(binDir, install.PluginType)); !os.IsNotExist(err) {
		t.Fatalf("binary still there: %v", err)
	}
	if !strings.Contains(string(out), "removed mtlsbridge-cni from "+conflist) {
		t.Fatalf("output: %s", out)
	}
}
