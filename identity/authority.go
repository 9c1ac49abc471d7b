// SPDX-License-Identifier: Apache-2.0

package identity

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"
)

// Files of CA material in a CA folder (STATE_DIR/ca, --ca-dir) or keys of a
// CA Secret.
const (
	// CACertFile and CAKeyFile are the signing root and its key.
	CACertFile = "ca-cert.pem"
	CAKeyFile  = "ca-key.pem"
	// TrustedRootsFile holds older roots still trusted during a rotation.
	TrustedRootsFile = "trusted-roots.pem"
	// RootCertFile is the trust bundle the agent writes for clients: the
	// signing root first, then the trusted older roots.
	RootCertFile = "root-cert.pem"
)

// Material is a CA's signing root, its key, and the older roots it still
// trusts. Its key never leaves the process: no String, no JSON.
type Material struct {
	Root    *x509.Certificate
	key     crypto.Signer
	Trusted []*x509.Certificate
}

// ParseMaterial reads CA material from its PEM files' contents.
func ParseMaterial(certPEM, keyPEM, trustedPEM []byte) (*Material, error) {
	certs, err := parseCertificates(certPEM)
	if err != nil || len(certs) != 1 {
		return nil, fmt.Errorf("%s: want exactly one certificate (%v)", CACertFile, err)
	}
	root := certs[0]
	if !root.IsCA {
		return nil, fmt.Errorf("%s: not a CA certificate", CACertFile)
	}
	block, _ := pem.Decode(keyPEM)
	if block == nil {
		// Never include the content: it is a private key.
		return nil, fmt.Errorf("%s: no PEM block", CAKeyFile)
	}
	key, err := parsePrivateKey(block.Bytes)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", CAKeyFile, err)
	}
	if !publicKeysEqual(key.Public(), root.PublicKey) {
		return nil, fmt.Errorf("%s does not match %s", CAKeyFile, CACertFile)
	}
	trusted, err := parseCertificates(trustedPEM)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", TrustedRootsFile, err)
	}
	// The signing root may be listed too (a rotation's second step lists it
	// before it signs): the bundle names it once.
	trusted = slices.DeleteFunc(trusted, root.Equal)
	return &Material{Root: root, key: key, Trusted: trusted}, nil
}

func parsePrivateKey(der []byte) (crypto.Signer, error) {
	if k, err := x509.ParsePKCS8PrivateKey(der); err == nil {
		if s, ok := k.(crypto.Signer); ok {
			return s, nil
		}
	}
	if k, err := x509.ParseECPrivateKey(der); err == nil {
		return k, nil
	}
	if k, err := x509.ParsePKCS1PrivateKey(der); err == nil {
		return k, nil
	}
	return nil, errors.New("not a PKCS#8, EC or PKCS#1 private key")
}

func publicKeysEqual(a, b crypto.PublicKey) bool {
	ea, ok := a.(interface{ Equal(crypto.PublicKey) bool })
	return ok && ea.Equal(b)
}

func parseCertificates(data []byte) ([]*x509.Certificate, error) {
	var out []*x509.Certificate
	for len(bytes.TrimSpace(data)) > 0 {
		var block *pem.Block
		block, data = pem.Decode(data)
		if block == nil {
			return out, errors.New("trailing data is not PEM")
		}
		if block.Type != "CERTIFICATE" {
			continue
		}
		c, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			return out, err
		}
		out = append(out, c)
	}
	return out, nil
}

// Bundle is the trust bundle: the signing root, then the older trusted roots.
func (m *Material) Bundle() []*x509.Certificate {
	return append([]*x509.Certificate{m.Root}, m.Trusted...)
}

// BundlePEM is Bundle in PEM.
func (m *Material) BundlePEM() []byte { return encodeCertificates(m.Bundle()) }

// encodeCertificates is certs in PEM, one after the other.
func encodeCertificates(certs []*x509.Certificate) []byte {
	var b bytes.Buffer
	for _, c := range certs {
		pem.Encode(&b, &pem.Block{Type: "CERTIFICATE", Bytes: c.Raw})
	}
	return b.Bytes()
}

// NewRootMaterial creates a self-signed ECDSA P-256 root for a trust domain.
func NewRootMaterial(trustDomain string, validity time.Duration) (certPEM, keyPEM []byte, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	serial, err := newSerial()
	if err != nil {
		return nil, nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{Organization: []string{trustDomain}, CommonName: "mtlsbridge root CA " + now.UTC().Format("2006-01-02T15:04:05Z")},
		NotBefore:             now.Add(-time.Minute),
		NotAfter:              now.Add(validity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
		URIs:                  []*url.URL{{Scheme: "spiffe", Host: trustDomain}},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return nil, nil, err
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}), nil
}

func newSerial() (*big.Int, error) {
	return rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 128))
}

// LoadDir reads CA material from a folder; generate creates it first when
// the folder has none (folder mode's first start).
func LoadDir(dir, trustDomain string, generate bool) (*Material, error) {
	if _, err := os.Stat(filepath.Join(dir, CACertFile)); errors.Is(err, os.ErrNotExist) && generate {
		if err := writeNewRoot(dir, trustDomain); err != nil {
			return nil, err
		}
	}
	return loadMaterial(dirFiles(dir))
}

// rootValidity is the lifetime of a generated root.
const rootValidity = 10 * 365 * 24 * time.Hour

func writeNewRoot(dir, trustDomain string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	certPEM, keyPEM, err := NewRootMaterial(trustDomain, rootValidity)
	if err != nil {
		return err
	}
	return writeRoot(dirFiles(dir), CACertFile, CAKeyFile, certPEM, keyPEM)
}

// Authority signs workload certificates with the current material, which a
// rotation may replace at any time.
type Authority struct {
	mu       sync.RWMutex
	material *Material
	err      error // why there is no material, when there is none
	serving  map[string]*tls.Certificate
}

// Set replaces the material (nil with the reason it is unavailable).
func (a *Authority) Set(m *Material, err error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.material, a.err = m, err
	a.serving = nil
}

// Material returns the current material, or why there is none.
func (a *Authority) Material() (*Material, error) {
	a.mu.RLock()
	defer a.mu.RUnlock()
	if a.material == nil {
		if a.err == nil {
			return nil, errors.New("CA material not loaded yet")
		}
		return nil, a.err
	}
	return a.material, nil
}

// Issued is a signed certificate with the chain to send back.
type Issued struct {
	Leaf *x509.Certificate
	// ChainPEM is [leaf, roots]: the leaf's PEM, then every trusted root
	// (the signing root first) concatenated in one element.
	ChainPEM []string
}

// SignWorkload signs a leaf for the CSR's key with exactly the one URI SAN
// id, valid for ttl (never beyond the root).
func (a *Authority) SignWorkload(csr *x509.CertificateRequest, id string, ttl time.Duration) (*Issued, error) {
	m, err := a.Material()
	if err != nil {
		return nil, err
	}
	u, err := url.Parse(id)
	if err != nil {
		return nil, err
	}
	serial, err := newSerial()
	if err != nil {
		return nil, err
	}
	now := time.Now()
	notAfter := now.Add(ttl)
	if notAfter.After(m.Root.NotAfter) {
		notAfter = m.Root.NotAfter
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		NotBefore:             now.Add(-time.Minute), // tolerate small clock skew
		NotAfter:              notAfter,
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		BasicConstraintsValid: true,
		URIs:                  []*url.URL{u},
	}
	return a.sign(m, tmpl, csr.PublicKey)
}

func (a *Authority) sign(m *Material, tmpl *x509.Certificate, pub crypto.PublicKey) (*Issued, error) {
	der, err := x509.CreateCertificate(rand.Reader, tmpl, m.Root, pub, m.key)
	if err != nil {
		return nil, fmt.Errorf("sign: %w", err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	// The API's contract: the roots are the chain's last element. Every
	// trusted root goes there, concatenated, as istiod does: istio-agent
	// takes that one element as its trust anchor, and during a rotation
	// it must hold the new root as well as the old.
	chain := []string{string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})), string(m.BundlePEM())}
	return &Issued{Leaf: leaf, ChainPEM: chain}, nil
}

// servingValidity is the lifetime of the listener's own certificate; it is
// renewed when a third of it is left.
const servingValidity = 24 * time.Hour

// ServingCertificate implements grpcserver.ServingCertSource: a certificate
// for the gRPC listener, issued by this CA for hosts.
func (a *Authority) ServingCertificate(hosts []string) (*tls.Certificate, error) {
	key := strings.Join(hosts, ",")
	a.mu.RLock()
	cached := a.serving[key]
	a.mu.RUnlock()
	if cached != nil && time.Until(cached.Leaf.NotAfter) > servingValidity/3 {
		return cached, nil
	}
	m, err := a.Material()
	if err != nil {
		return nil, err
	}
	priv, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	serial, err := newSerial()
	if err != nil {
		return nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: "mtlsbridge"},
		NotBefore:    now.Add(-time.Minute),
		NotAfter:     now.Add(servingValidity),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, h)
		}
	}
	issued, err := a.sign(m, tmpl, priv.Public())
	if err != nil {
		return nil, err
	}
	cert := &tls.Certificate{Certificate: [][]byte{issued.Leaf.Raw}, PrivateKey: priv, Leaf: issued.Leaf}
	a.mu.Lock()
	if a.material == m {
		if a.serving == nil {
			a.serving = map[string]*tls.Certificate{}
		}
		a.serving[key] = cert
	}
	a.mu.Unlock()
	return cert, nil
}

// equalMaterial reports whether a reload changed nothing.
func equalMaterial(a, b *Material) bool {
	if a == nil || b == nil {
		return a == b
	}
	return a.Root.Equal(b.Root) && slices.EqualFunc(a.Trusted, b.Trusted, (*x509.Certificate).Equal)
}
