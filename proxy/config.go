// SPDX-License-Identifier: Apache-2.0

package proxy

import (
	"crypto/x509"
	"fmt"
	"net"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/mtlsbridge/mtlsbridge/spiffe"
)

// Environment variables of ztunnel's contract, read with the same names and
// defaults so that a node agent cannot tell this proxy from ztunnel.
const (
	EnvXDSAddress   = "XDS_ADDRESS"   // https://HOST:PORT of delta ADS
	EnvCAAddress    = "CA_ADDRESS"    // https://HOST:PORT of IstioCertificateService; default XDS_ADDRESS
	EnvXDSRootCA    = "XDS_ROOT_CA"   // PEM file, literal PEM, or SYSTEM
	EnvCARootCA     = "CA_ROOT_CA"    // the same for the CA
	EnvAuthToken    = "AUTH_TOKEN"    // bearer token file, re-read per connection
	EnvPodName      = "POD_NAME"      // the proxy's own pod
	EnvPodNamespace = "POD_NAMESPACE" // its namespace
	EnvNodeName     = "NODE_NAME"     // workloads of this node are local
	EnvTrustDomain  = "TRUST_DOMAIN"  // of peer certificates; default cluster.local
	EnvClusterID    = "CLUSTER_ID"    // sent as gRPC metadata clusterid and node metadata
	EnvInstanceIP   = "INSTANCE_IP"   // the proxy pod's address, in its xDS node id
	// EnvInPodUDS is ztunnel's in-pod socket: when set, the proxy runs in
	// the in-pod mode, as ztunnel does (ZDS client, listeners inside each
	// pod's namespace), instead of the l2 mode's capture.
	EnvInPodUDS = "INPOD_UDS"
	// EnvMetaPrefix: ISTIO_META_NAME=VALUE becomes node metadata NAME.
	EnvMetaPrefix = "ISTIO_META_"

	// EnvCapture is this proxy's own: "false" skips installing the
	// nftables capture (when something else redirects, or in tests that
	// hand connections to the listeners directly).
	EnvCapture = "MTLSBRIDGE_PROXY_CAPTURE"
	// EnvIdleTimeout closes a proxied connection after this long without a
	// byte in either direction (Go duration; default 1h; 0 disables).
	EnvIdleTimeout = "MTLSBRIDGE_PROXY_IDLE_TIMEOUT"
)

// Defaults as ztunnel's (the two file paths are ztunnel's, rooted).
const (
	DefaultXDSAddress  = "https://localhost:15012"
	DefaultRootCA      = "/var/run/secrets/istio/root-cert.pem"
	DefaultTokenPath   = "/var/run/secrets/tokens/istio-token"
	DefaultClusterID   = "Kubernetes"
	DefaultIdleTimeout = time.Hour
	// rootCASystem asks for the system's trust store.
	rootCASystem = "SYSTEM"
)

// Ports of ztunnel's listeners.
const (
	AdminPort     = 15000
	OutboundPort  = 15001
	HBONEPort     = 15008
	MetricsPort   = 15020
	ReadinessPort = 15021
)

// ownPort: a port of the proxy's listeners in a pod (ztunnel's illegal
// ports). A connection to a pod's address there is a call to the proxy
// itself: it would loop through its listeners, each turn taking a slot,
// or nest a tunnel in a tunnel.
func ownPort(port uint16) bool {
	return port == OutboundPort || port == InboundPlainPort || port == HBONEPort
}

// Config is the proxy's configuration.
type Config struct {
	XDSAddress, CAAddress string // host:port
	XDSRoot, CARoot       RootCA
	TokenPath             string
	PodName, PodNamespace string
	NodeName              string
	TrustDomain           string
	ClusterID             string
	InstanceIP            string
	// Metadata is added to the xDS node metadata (ISTIO_META_*).
	Metadata map[string]string

	Capture     bool
	IdleTimeout time.Duration
	// InPodUDS, when set, selects the in-pod mode: the node agent's ZDS
	// socket. Capture and the loopback listeners are then not used.
	InPodUDS string

	// Listen addresses; the defaults are ztunnel's ports. The outbound and
	// HBONE listeners are on loopback: only TPROXY reaches them.
	OutboundListen  []string
	HBONEListen     []string
	ReadinessListen string
	MetricsListen   string
	// AdminListen serves /config_dump, on loopback only as ztunnel's.
	AdminListen string

	// CertificateValidity is asked of the CA (ztunnel's default, 24h; the
	// CA bounds it).
	CertificateValidity time.Duration
	// Now is the clock of certificate renewal; tests move it.
	Now func() time.Time
}

// RootCA is where a trust bundle for a gRPC server comes from.
type RootCA struct {
	// Path of a PEM file, read at each connection (root rotation).
	Path string
	// PEM given literally.
	PEM []byte
	// System: the host's trust store.
	System bool
}

// Pool reads the bundle.
func (r RootCA) Pool() (*x509.CertPool, error) {
	if r.System {
		return x509.SystemCertPool()
	}
	pem := r.PEM
	if r.Path != "" {
		b, err := os.ReadFile(r.Path)
		if err != nil {
			return nil, err
		}
		pem = b
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("no PEM certificate in %s", r)
	}
	return pool, nil
}

func (r RootCA) String() string {
	switch {
	case r.System:
		return rootCASystem
	case r.Path != "":
		return r.Path
	}
	return "literal PEM"
}

// parseRootCA reads a XDS_ROOT_CA-style value as ztunnel does: an existing
// file, SYSTEM, or else the PEM itself.
func parseRootCA(v string) RootCA {
	if v == "" {
		v = DefaultRootCA
	}
	if _, err := os.Stat(v); err == nil {
		return RootCA{Path: v}
	}
	if v == rootCASystem {
		return RootCA{System: true}
	}
	if strings.Contains(v, "-----BEGIN") {
		return RootCA{PEM: []byte(v)}
	}
	// A path that does not exist yet (a volume still mounting): read it at
	// each connection and fail until it is there.
	return RootCA{Path: v}
}

// ConfigFromEnv reads the configuration from environment variables through
// getenv (os.Getenv) and environ (os.Environ, for ISTIO_META_*).
//
// Possible errors: ErrConfig naming the variable.
func ConfigFromEnv(getenv func(string) string, environ []string) (Config, error) {
	c := Config{
		XDSRoot:             parseRootCA(getenv(EnvXDSRootCA)),
		CARoot:              parseRootCA(getenv(EnvCARootCA)),
		TokenPath:           orDefault(getenv(EnvAuthToken), DefaultTokenPath),
		PodName:             getenv(EnvPodName),
		PodNamespace:        getenv(EnvPodNamespace),
		NodeName:            getenv(EnvNodeName),
		TrustDomain:         orDefault(getenv(EnvTrustDomain), spiffe.DefaultTrustDomain),
		ClusterID:           orDefault(getenv("ISTIO_META_CLUSTER_ID"), orDefault(getenv(EnvClusterID), DefaultClusterID)),
		InstanceIP:          getenv(EnvInstanceIP),
		InPodUDS:            getenv(EnvInPodUDS),
		Metadata:            map[string]string{},
		Capture:             true,
		IdleTimeout:         DefaultIdleTimeout,
		CertificateValidity: 24 * time.Hour,
	}
	var err error
	if c.XDSAddress, err = parseAddress(EnvXDSAddress, orDefault(getenv(EnvXDSAddress), DefaultXDSAddress)); err != nil {
		return c, err
	}
	c.CAAddress = c.XDSAddress
	if v := getenv(EnvCAAddress); v != "" {
		if c.CAAddress, err = parseAddress(EnvCAAddress, v); err != nil {
			return c, err
		}
	}
	for _, kv := range environ {
		k, v, _ := strings.Cut(kv, "=")
		if name, ok := strings.CutPrefix(k, EnvMetaPrefix); ok && name != "" {
			c.Metadata[name] = v
		}
	}
	if v := getenv(EnvCapture); v != "" {
		if c.Capture, err = strconv.ParseBool(v); err != nil {
			return c, fmt.Errorf("%w: %s=%q: %v", ErrConfig, EnvCapture, v, err)
		}
	}
	if v := getenv(EnvIdleTimeout); v != "" {
		if c.IdleTimeout, err = time.ParseDuration(v); err != nil || c.IdleTimeout < 0 {
			return c, fmt.Errorf("%w: %s=%q: want a duration >= 0", ErrConfig, EnvIdleTimeout, v)
		}
	}
	return c, c.Validate()
}

// Validate checks the fields the proxy cannot run without.
func (c *Config) Validate() error {
	for _, f := range []struct{ name, value string }{
		{EnvPodName, c.PodName}, {EnvPodNamespace, c.PodNamespace}, {EnvNodeName, c.NodeName},
	} {
		if f.value == "" {
			return fmt.Errorf("%w: %s is not set", ErrConfig, f.name)
		}
	}
	if err := spiffe.ValidateTrustDomain(c.TrustDomain); err != nil {
		return fmt.Errorf("%w: %s=%q: %v", ErrConfig, EnvTrustDomain, c.TrustDomain, err)
	}
	if c.InPodUDS != "" && !filepath.IsAbs(c.InPodUDS) {
		return fmt.Errorf("%w: %s=%q: want an absolute path", ErrConfig, EnvInPodUDS, c.InPodUDS)
	}
	if c.InstanceIP != "" {
		if _, err := netip.ParseAddr(c.InstanceIP); err != nil {
			return fmt.Errorf("%w: %s=%q: %v", ErrConfig, EnvInstanceIP, c.InstanceIP, err)
		}
	}
	return nil
}

// withDefaults fills the listen addresses and the clock.
func (c Config) withDefaults() Config {
	if c.OutboundListen == nil {
		c.OutboundListen = loopbacks(OutboundPort)
	}
	if c.HBONEListen == nil {
		c.HBONEListen = loopbacks(HBONEPort)
	}
	if c.ReadinessListen == "" {
		c.ReadinessListen = ":" + strconv.Itoa(ReadinessPort)
	}
	if c.MetricsListen == "" {
		c.MetricsListen = ":" + strconv.Itoa(MetricsPort)
	}
	if c.AdminListen == "" {
		c.AdminListen = net.JoinHostPort("127.0.0.1", strconv.Itoa(AdminPort))
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.CertificateValidity == 0 {
		c.CertificateValidity = 24 * time.Hour
	}
	return c
}

func loopbacks(port int) []string {
	p := strconv.Itoa(port)
	return []string{net.JoinHostPort("127.0.0.1", p), net.JoinHostPort("::1", p)}
}

// parseAddress accepts ztunnel's https://HOST:PORT, and HOST:PORT.
func parseAddress(name, v string) (string, error) {
	hostport := v
	if strings.Contains(v, "://") {
		u, err := url.Parse(v)
		if err != nil || u.Scheme != "https" {
			return "", fmt.Errorf("%w: %s=%q: want https://HOST:PORT (TLS is mandatory)", ErrConfig, name, v)
		}
		hostport = u.Host
	}
	if _, _, err := net.SplitHostPort(hostport); err != nil {
		return "", fmt.Errorf("%w: %s=%q: %v", ErrConfig, name, v, err)
	}
	return hostport, nil
}

func orDefault(v, def string) string {
	if v == "" {
		return def
	}
	return v
}
