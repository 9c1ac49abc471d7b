// SPDX-License-Identifier: Apache-2.0

package identity

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"
	pb "istio.io/api/security/v1alpha1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/mtlsbridge/mtlsbridge/api"
	"github.com/mtlsbridge/mtlsbridge/grpcserver"
	"github.com/mtlsbridge/mtlsbridge/internal/atomicfile"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/enrollment"
	"github.com/mtlsbridge/mtlsbridge/statedir"
	"github.com/mtlsbridge/mtlsbridge/tables"
	"github.com/mtlsbridge/mtlsbridge/tables/ingest"
)

// Cell runs the certificate authority of the node's mTLS agent.
var Cell = cell.Module(
	"identity",
	"Certificate authority for the mTLS agent",

	cell.Config(defaultConfig),
	cell.Provide(newMetrics),
	// The CA's material, loaded and reloaded by the loader below.
	cell.Provide(func() *Authority { return &Authority{} }),
	// Readiness: without material, every TLS client of the listener fails.
	cell.Provide(func(a *Authority) api.CheckOut {
		return api.CheckOut{Check: api.Check{Name: "ca-material", Err: func() error { _, err := a.Material(); return err }}}
	}),
	// The gRPC listener's own certificate comes from this CA unless files are given.
	cell.Provide(func(a *Authority) grpcserver.ServingCertSource { return a }),
	// The issued certificates, written only by the CA service.
	cell.ProvidePrivate(NewCertificatesTable),
	cell.Provide(statedb.RWTable[*Certificate].ToTable),
	cell.Provide(newCAService),
	cell.Invoke(registerLoader),
)

// Config of the certificate authority.
type Config struct {
	// CADir holds the CA material as files (ca-cert.pem, ca-key.pem,
	// trusted-roots.pem). Default in folder mode: STATE_DIR/ca, generated on
	// first start. In Kubernetes mode: a mounted Secret, else --ca-secret.
	CADir string
	// CASecret is NAMESPACE/NAME of the Secret with the CA material
	// (Kubernetes mode, when --ca-dir is not set).
	CASecret string
	// CAMaxCertTTL bounds the validity a client may ask for.
	CAMaxCertTTL time.Duration
	// CADefaultCertTTL is the validity when the client asks for none.
	CADefaultCertTTL time.Duration
	// CAReloadInterval is how often the material is checked for a rotation.
	CAReloadInterval time.Duration
	// CACertificateRetention is how long an expired certificate stays listed.
	CACertificateRetention time.Duration
	// CAUpstream is the signer's host:port. When set, certificate requests
	// this node's CA accepts are signed there, and the node holds no CA
	// key: its own CA (generated in STATE_DIR/serving-ca) signs only the
	// listener's certificate.
	CAUpstream string
	// CAUpstreamRoots is the file of the trust domain's roots, which the
	// signer's serving certificate and the certificates it returns chain to.
	CAUpstreamRoots string
	// CAUpstreamTokenFile is this node agent's token for the signer.
	CAUpstreamTokenFile string
}

var defaultConfig = Config{
	CASecret:               "kube-system/mtlsbridge-ca",
	CAMaxCertTTL:           24 * time.Hour,
	CADefaultCertTTL:       24 * time.Hour,
	CAReloadInterval:       10 * time.Second,
	CACertificateRetention: time.Hour,
}

// Flags implements cell.Flagger.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.String("ca-dir", def.CADir, "Folder with ca-cert.pem, ca-key.pem and optional trusted-roots.pem (default in folder mode: STATE_DIR/ca, generated on first start)")
	flags.String("ca-secret", def.CASecret, "Kubernetes mode without --ca-dir: NAMESPACE/NAME of the Secret holding the same keys")
	flags.Duration("ca-max-cert-ttl", def.CAMaxCertTTL, "Longest validity of a workload certificate")
	flags.Duration("ca-default-cert-ttl", def.CADefaultCertTTL, "Validity of a workload certificate when none is asked for")
	flags.Duration("ca-reload-interval", def.CAReloadInterval, "How often CA material is re-read (root rotation)")
	flags.Duration("ca-certificate-retention", def.CACertificateRetention, "How long expired certificates stay in the certificates table")
	flags.String("ca-upstream", def.CAUpstream, "host:port of the signer (mtlsbridge signer): certificates are signed there and this node holds no CA key")
	flags.String("ca-upstream-roots", def.CAUpstreamRoots, "With --ca-upstream: PEM file of the trust domain's roots, which the signer's certificate and those it returns must chain to (re-read at each use)")
	flags.String("ca-upstream-token-file", def.CAUpstreamTokenFile, "With --ca-upstream: this node agent's bearer token for the signer (re-read at each request)")
}

func (c Config) validate() error {
	switch {
	case c.CAMaxCertTTL < minCertTTL:
		return fmt.Errorf("--ca-max-cert-ttl=%s: want at least %s", c.CAMaxCertTTL, minCertTTL)
	case c.CADefaultCertTTL < minCertTTL || c.CADefaultCertTTL > c.CAMaxCertTTL:
		return fmt.Errorf("--ca-default-cert-ttl=%s: want between %s and --ca-max-cert-ttl", c.CADefaultCertTTL, minCertTTL)
	case c.CAReloadInterval <= 0:
		return fmt.Errorf("--ca-reload-interval must be positive")
	case c.CAUpstream != "" && c.CADir != "":
		return fmt.Errorf("--ca-upstream and --ca-dir: with a signer upstream the node holds no CA material")
	}
	return nil
}

type caParams struct {
	cell.In

	Config       Config
	Enrollment   enrollment.Config
	LocalNode    tables.LocalNode
	Log          *slog.Logger
	Metrics      *Metrics
	Authority    *Authority
	DB           *statedb.DB
	Enrollments  statedb.Table[*enrollment.Enrollment]
	Certificates statedb.RWTable[*Certificate]
	Lifecycle    cell.Lifecycle
	Clients      *ingest.Clients
	Mode         ingest.Mode
	Pods         statedb.Table[*tables.Pod]
	// Callers is provided in the signer only.
	Callers grpcserver.Callers `optional:"true"`
}

// caServiceOut registers the CA on the gRPC listener and bounds how many
// of its requests are read at once.
type caServiceOut struct {
	cell.Out

	Service grpcserver.Service     `group:"grpc-services"`
	Bound   grpcserver.MethodBound `group:"grpc-method-bounds"`
	// Check warns while the last request forwarded to the signer failed.
	Check api.Check `group:"readiness-checks"`
}

// concurrentRequests bounds the certificate requests read at once: the
// listener's message limit is that of xDS (megabytes), a CSR needs
// kilobytes, and gRPC reads a request before any handler sees it.
const concurrentRequests = 8

func newCAService(p caParams) (caServiceOut, error) {
	if err := p.Config.validate(); err != nil {
		return caServiceOut{}, err
	}
	s := &caService{
		cfg: p.Config, trustDomain: p.Enrollment.TrustDomain, localNode: p.LocalNode, log: p.Log,
		metrics: p.Metrics, authority: p.Authority, db: p.DB,
		enrollments: p.Enrollments, certificates: p.Certificates, callers: p.Callers,
		pods: p.Pods, kubernetes: p.Mode == ingest.Kubernetes,
	}
	if p.Config.CAUpstream != "" {
		if len(p.Callers.NodeAgents) > 0 {
			return caServiceOut{}, fmt.Errorf("--ca-upstream: the signer signs itself")
		}
		var kube kubernetes.Interface
		if p.Clients != nil {
			kube = p.Clients.Kube
		}
		up, err := newUpstream(p.Config, kube)
		if err != nil {
			return caServiceOut{}, err
		}
		s.upstream = up
		stop := make(chan struct{})
		p.Lifecycle.Append(cell.Hook{
			OnStart: func(cell.HookContext) error { up.start(stop); return nil },
			OnStop:  func(cell.HookContext) error { close(stop); return up.conn.Close() },
		})
	}
	return caServiceOut{
		Check: api.Check{Name: "ca-upstream", Warning: true, Err: func() error {
			if s.upstream == nil {
				return nil
			}
			return s.upstream.lastErr()
		}},
		Service: s.register,
		Bound:   grpcserver.MethodBound{Method: pb.IstioCertificateService_CreateCertificate_FullMethodName, Concurrent: concurrentRequests},
	}, nil
}

type loaderParams struct {
	cell.In

	Config       Config
	StateDir     statedir.Dir
	Enrollment   enrollment.Config
	Log          *slog.Logger
	Lifecycle    cell.Lifecycle
	Jobs         job.Registry
	Health       cell.Health
	Authority    *Authority
	Mode         ingest.Mode
	Clients      *ingest.Clients
	DB           *statedb.DB
	Certificates statedb.RWTable[*Certificate]
}

// loader keeps the Authority's material current and writes the trust
// bundle for clients.
type loader struct {
	loaderParams
	read func(ctx context.Context) (*Material, error)
	// mu serializes reloads (the start hook's and the timer's).
	mu sync.Mutex
	// bundleWritten: the trust bundle on disk is the loaded material's; a
	// write that failed is tried again at the next reload.
	bundleWritten bool
}

func registerLoader(p loaderParams) {
	l := &loader{loaderParams: p}
	switch dir := p.Config.CADir; {
	case dir != "":
		l.read = func(context.Context) (*Material, error) {
			return LoadDir(dir, p.Enrollment.TrustDomain, p.Mode == ingest.Folder)
		}
	case p.Config.CAUpstream != "":
		// With a signer upstream, this CA only serves the listener: a key
		// of this node's own, apart from STATE_DIR/ca, where folder mode
		// keeps the trust domain's.
		dir = p.StateDir.Path("serving-ca")
		l.read = func(context.Context) (*Material, error) { return LoadDir(dir, p.Enrollment.TrustDomain, true) }
	case p.Mode == ingest.Folder:
		dir = p.StateDir.Path("ca")
		l.read = func(context.Context) (*Material, error) { return LoadDir(dir, p.Enrollment.TrustDomain, true) }
	default:
		l.read = l.readSecret
	}
	jobs := p.Jobs.NewGroup(p.Health)
	// Load before the listener starts, so that it has a certificate to serve.
	p.Lifecycle.Append(cell.Hook{OnStart: func(ctx cell.HookContext) error {
		l.reload(ctx, nil)
		return nil
	}})
	jobs.Add(
		job.Timer("reload-ca", func(ctx context.Context) error { l.reload(ctx, nil); return nil }, p.Config.CAReloadInterval),
		job.Timer("forget-expired-certificates", l.forgetExpired, time.Minute),
	)
}

// reload re-reads the material; a failure keeps the material loaded before
// (a half-written rotation must not stop issuance).
func (l *loader) reload(ctx context.Context, _ cell.Health) {
	l.mu.Lock()
	defer l.mu.Unlock()
	m, err := l.read(ctx)
	old, oldErr := l.Authority.Material()
	switch {
	case err != nil && oldErr == nil:
		l.Log.Error("Reloading CA material failed; keeping the loaded material", "error", err)
		return
	case err != nil:
		l.Log.Error("No CA material: certificate requests fail until it is available", "error", err)
		l.Authority.Set(nil, err)
		return
	case equalMaterial(old, m) && l.bundleWritten:
		return
	case !equalMaterial(old, m):
		l.Authority.Set(m, nil)
		l.bundleWritten = false
		l.Log.Info("CA material loaded", "root", m.Root.Subject.CommonName, "trustedOtherRoots", len(m.Trusted),
			"notAfter", m.Root.NotAfter)
	}
	bundle := l.StateDir.Path("ca", RootCertFile)
	err = os.MkdirAll(filepath.Dir(bundle), 0o700)
	if err == nil {
		err = atomicfile.Write(bundle, m.BundlePEM(), 0o644)
	}
	if err != nil {
		l.Log.Error("Cannot write the trust bundle for the mTLS agent; trying again at the next reload", "bundle", bundle, "error", err)
		return
	}
	l.bundleWritten = true
	l.Log.Info("Trust bundle written", "bundle", bundle, "roots", 1+len(m.Trusted))
}

func (l *loader) readSecret(ctx context.Context) (*Material, error) {
	ns, name, err := namespacedName("--ca-secret", l.Config.CASecret)
	if err != nil {
		return nil, err
	}
	secret, err := l.Clients.Kube.CoreV1().Secrets(ns).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("CA secret %s: %w", l.Config.CASecret, err)
	}
	m, err := ParseMaterial(secret.Data[CACertFile], secret.Data[CAKeyFile], secret.Data[TrustedRootsFile])
	if err != nil {
		return nil, fmt.Errorf("CA secret %s: %w", l.Config.CASecret, err)
	}
	return m, nil
}

// forgetExpired drops certificates expired longer than the retention.
func (l *loader) forgetExpired(ctx context.Context) error {
	cutoff := time.Now().Add(-l.Config.CACertificateRetention)
	txn := l.DB.WriteTxn(l.Certificates)
	defer txn.Commit()
	var expired []*Certificate
	for c := range l.Certificates.All(txn) {
		if c.NotAfter.Before(cutoff) {
			expired = append(expired, c)
		}
	}
	for _, c := range expired {
		l.Certificates.Delete(txn, c)
	}
	return nil
}
