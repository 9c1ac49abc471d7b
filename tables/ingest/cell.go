// SPDX-License-Identifier: Apache-2.0

// Package ingest fills the tables of package tables from the Kubernetes API
// or from a folder of YAML manifests, and is their only writer.
package ingest

import (
	"fmt"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/pflag"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/mtlsbridge/mtlsbridge/tables"
)

// Cell provides the tables of package tables, read-only, and fills them.
var Cell = cell.Module(
	"sources",
	"Kubernetes objects or YAML manifests into tables",

	cell.Config(defaultConfig),
	// The writable tables stay private: the sources are their only writers.
	cell.ProvidePrivate(newWriteTables),
	// Everyone else reads them.
	cell.Provide(
		func(w *writeTables) statedb.Table[*tables.Pod] { return w.Pods },
		func(w *writeTables) statedb.Table[*tables.Namespace] { return w.Namespaces },
		func(w *writeTables) statedb.Table[*tables.Policy] { return w.Policies },
		func(w *writeTables) statedb.Table[*tables.Node] { return w.Nodes },
		func(w *writeTables) statedb.Table[*tables.Source] { return w.Sources },
	),
	// Where objects come from, for the components that act differently
	// in folder mode (the CA's material, readiness published on pods,
	// caller authentication, the node taint).
	cell.Provide(Config.mode),
	// Kubernetes clients (Kubernetes mode only; nil in folder mode);
	// later components use them too.
	cell.Provide(newClients),
	cell.Invoke(startSources),
	// mtlsbridge_policies_invalid: policies whose current version is not
	// understood (those that keep a last valid version included).
	cell.Invoke(registerMetrics),
)

func registerMetrics(reg *prometheus.Registry, w *writeTables) error {
	return reg.Register(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "mtlsbridge_policies_invalid",
		Help: "Cilium policies whose current version is invalid (an invalid version of a valid policy keeps enrolling what the valid one selected)",
	}, func() float64 {
		n := 0
		for p := range w.Policies.All(w.DB.ReadTxn()) {
			if p.Error != "" {
				n++
			}
		}
		return float64(n)
	}))
}

// Config selects where objects come from.
type Config struct {
	// Source is "k8s" (the Kubernetes API) or "dir:PATH" (a folder of YAML
	// manifests, followed while running).
	Source string
	// Kubeconfig is the kubeconfig file for "k8s"; empty means in-cluster,
	// else $KUBECONFIG.
	Kubeconfig string
	// KubeAPIQPS and KubeAPIBurst bound the agent's requests to the API
	// server (token reviews have a budget of their own).
	KubeAPIQPS   float64
	KubeAPIBurst int
	// ManifestMaxBytes is the largest manifest file read.
	ManifestMaxBytes int64
}

// Cilium's own defaults for its agent's client.
var defaultConfig = Config{Source: "k8s", KubeAPIQPS: 10, KubeAPIBurst: 20, ManifestMaxBytes: 64 << 20}

// Flags implements cell.Flagger.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.String("source", def.Source, `Where objects come from: "k8s" (the Kubernetes API) or "dir:PATH" (a folder of YAML manifests)`)
	flags.String("kubeconfig", def.Kubeconfig, "kubeconfig file for --source=k8s (default: in-cluster, else $KUBECONFIG)")
	flags.Float64("kube-api-qps", def.KubeAPIQPS, "Requests per second to the Kubernetes API server at most")
	flags.Int("kube-api-burst", def.KubeAPIBurst, "Requests to the Kubernetes API server in a burst at most")
	flags.Int64("manifest-max-bytes", def.ManifestMaxBytes, "--source=dir: largest manifest file read")
}

// Mode is where the agent's view of the cluster comes from.
type Mode int

const (
	// Kubernetes: the API server (--source=k8s), through reflectors.
	Kubernetes Mode = iota + 1
	// Folder: a folder of YAML manifests (--source=dir:PATH), followed
	// while running; nothing is written back to a cluster.
	Folder
)

func (m Mode) String() string {
	if m == Kubernetes {
		return "kubernetes"
	}
	return "folder"
}

func (c Config) mode() (Mode, error) {
	dir, err := c.dir()
	if err != nil {
		return 0, err
	}
	if dir != "" {
		return Folder, nil
	}
	return Kubernetes, nil
}

// dir returns the manifest folder, or "" in Kubernetes mode.
func (c Config) dir() (string, error) {
	switch {
	case c.Source == "k8s":
		return "", nil
	case strings.HasPrefix(c.Source, "dir:"):
		if c.ManifestMaxBytes < 1 {
			return "", fmt.Errorf("--manifest-max-bytes=%d: must be positive", c.ManifestMaxBytes)
		}
		dir := strings.TrimPrefix(c.Source, "dir:")
		if dir == "" {
			return "", fmt.Errorf("--source=dir: needs a folder, e.g. --source=dir:/etc/mtlsbridge/manifests")
		}
		info, err := os.Stat(dir)
		if err != nil {
			return "", fmt.Errorf("--source=%s: %w", c.Source, err)
		}
		if !info.IsDir() {
			return "", fmt.Errorf("--source=%s: not a folder", c.Source)
		}
		return dir, nil
	}
	return "", fmt.Errorf(`--source=%q: want "k8s" or "dir:PATH"`, c.Source)
}

// Clients talk to the Kubernetes API.
type Clients struct {
	Kube    kubernetes.Interface
	Dynamic dynamic.Interface
	Config  *rest.Config
}

func newClients(cfg Config, mode Mode) (*Clients, error) {
	if mode != Kubernetes {
		return nil, nil
	}
	if cfg.KubeAPIQPS <= 0 || cfg.KubeAPIBurst < 1 {
		return nil, fmt.Errorf("--kube-api-qps and --kube-api-burst must be positive")
	}
	restCfg, err := restConfig(cfg.Kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("kubernetes client configuration: %w", err)
	}
	restCfg.QPS, restCfg.Burst = float32(cfg.KubeAPIQPS), cfg.KubeAPIBurst
	restCfg.UserAgent = "mtlsbridge"
	return NewClients(restCfg)
}

// NewClients builds the clients for a REST configuration.
func NewClients(restCfg *rest.Config) (*Clients, error) {
	kube, err := kubernetes.NewForConfig(restCfg)
	if err != nil {
		return nil, err
	}
	dyn, err := dynamic.NewForConfig(restCfg)
	if err != nil {
		return nil, err
	}
	return &Clients{Kube: kube, Dynamic: dyn, Config: restCfg}, nil
}

func restConfig(kubeconfig string) (*rest.Config, error) {
	if kubeconfig == "" {
		if cfg, err := rest.InClusterConfig(); err == nil {
			return cfg, nil
		}
		kubeconfig = os.Getenv("KUBECONFIG")
		if kubeconfig == "" {
			return nil, fmt.Errorf("not running in a cluster and neither --kubeconfig nor $KUBECONFIG is set")
		}
	}
	return clientcmd.BuildConfigFromFlags("", kubeconfig)
}

func newWriteTables(db *statedb.DB, node tables.LocalNode, log *slog.Logger) (*writeTables, error) {
	w := &writeTables{DB: db, log: log}
	var err error
	if w.Pods, err = tables.NewPodsTable(db, node); err != nil {
		return nil, err
	}
	if w.Namespaces, err = tables.NewNamespacesTable(db); err != nil {
		return nil, err
	}
	if w.Policies, err = tables.NewPoliciesTable(db); err != nil {
		return nil, err
	}
	if w.Nodes, err = tables.NewNodesTable(db); err != nil {
		return nil, err
	}
	w.Sources, err = tables.NewSourcesTable(db)
	return w, err
}

type sourceParams struct {
	cell.In

	Config  Config
	Log     *slog.Logger
	Jobs    job.Registry
	Health  cell.Health
	Tables  *writeTables
	Clients *Clients
}

func startSources(p sourceParams) error {
	dir, err := p.Config.dir()
	if err != nil {
		return err
	}
	jobs := p.Jobs.NewGroup(p.Health)
	if dir == "" {
		jobs.Add(k8sJobs(p.Log, p.Clients, p.Tables)...)
		return nil
	}
	d := &dirSource{dir: dir, maxBytes: p.Config.ManifestMaxBytes, log: p.Log, tables: p.Tables, settle: 50 * time.Millisecond}
	txn := p.Tables.DB.WriteTxn(p.Tables.all()...)
	for _, t := range []writableTable{p.Tables.Pods, p.Tables.Namespaces, p.Tables.Policies, p.Tables.Nodes} {
		d.initDone = append(d.initDone, t.RegisterInitializer(txn, "manifests"))
	}
	txn.Commit()
	jobs.Add(job.OneShot("manifest-folder", d.run))
	return nil
}
