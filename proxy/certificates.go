// SPDX-License-Identifier: Apache-2.0

package proxy

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"encoding/pem"
	"fmt"
	"log/slog"
	"net/url"
	"slices"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/structpb"
	pb "istio.io/api/security/v1alpha1"
)

// Bounds of the certificate manager.
const (
	certRequestTimeout = 10 * time.Second
	certConcurrency    = 4
	certRetryFirst     = 500 * time.Millisecond
	certRetryMax       = 30 * time.Second
	// certRecheck is the longest the manager sleeps between looks at the
	// clock (renewals are due by Config.Now, which tests move).
	certRecheck = time.Second
)

// Certificates holds one certificate per identity of this node's
// workloads, asked of the CA with CreateCertificate on the workload's
// behalf (ImpersonatedIdentity), renewed at half life, and dropped when no
// local workload holds the identity any more. Its trust bundle is the
// union of the roots the CA returned with the certificates held.
type Certificates struct {
	cfg     Config
	state   *State
	metrics *Metrics
	log     *slog.Logger

	mu      sync.RWMutex
	held    map[string]*heldCertificate
	bundle  *x509.CertPool
	changed chan struct{}
}

type heldCertificate struct {
	cert      *tls.Certificate
	roots     []*x509.Certificate
	refreshAt time.Time
}

// NewCertificates returns a manager for state's local workloads.
func NewCertificates(cfg Config, state *State, metrics *Metrics, log *slog.Logger) *Certificates {
	return &Certificates{
		cfg: cfg, state: state, metrics: metrics, log: log,
		held: map[string]*heldCertificate{}, bundle: x509.NewCertPool(), changed: make(chan struct{}),
	}
}

// Get returns the certificate of an identity, or nil.
func (c *Certificates) Get(identity string) *tls.Certificate {
	c.mu.RLock()
	defer c.mu.RUnlock()
	if h := c.held[identity]; h != nil {
		return h.cert
	}
	return nil
}

// Bundle is the pool peers' certificates must chain to. Empty until a
// certificate is held: nothing verifies then.
func (c *Certificates) Bundle() *x509.CertPool {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return c.bundle
}

// Changed is closed at the next change of the certificates held.
func (c *Certificates) Changed() <-chan struct{} {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return c.changed
}

// HoldsAll tells whether a certificate is held for each local identity.
func (c *Certificates) HoldsAll() bool {
	c.mu.RLock()
	defer c.mu.RUnlock()
	for id := range c.state.LocalIdentities() {
		if c.held[id] == nil {
			return false
		}
	}
	return true
}

// Identities returns the identities held, sorted.
func (c *Certificates) Identities() []string {
	c.mu.RLock()
	defer c.mu.RUnlock()
	ids := make([]string, 0, len(c.held))
	for id := range c.held {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	return ids
}

// fetched is the outcome of one request.
type fetched struct {
	identity string
	cert     *heldCertificate
	err      error
}

// Run keeps the certificates until ctx ends.
func (c *Certificates) Run(ctx context.Context) {
	conn, err := dialGRPC(c.cfg.CAAddress, c.cfg.CARoot, tokenCredentials{path: c.cfg.TokenPath, clusterID: c.cfg.ClusterID})
	if err != nil {
		// Only a malformed address fails here; the configuration check
		// has ruled that out.
		c.log.Error("CA client", "address", c.cfg.CAAddress, "error", err)
		return
	}
	defer conn.Close()
	client := pb.NewIstioCertificateServiceClient(conn)

	var (
		results  = make(chan fetched)
		inflight = map[string]bool{}
		retryAt  = map[string]time.Time{}
		backoff  = map[string]time.Duration{}
		sem      = make(chan struct{}, certConcurrency)
		wg       sync.WaitGroup
	)
	defer wg.Wait()
	for {
		stateChanged := c.state.Changed()
		want := c.state.LocalIdentities()
		c.drop(want)
		now := c.cfg.Now()
		for id := range want {
			if inflight[id] || now.Before(retryAt[id]) || !c.due(id, now) {
				continue
			}
			inflight[id] = true
			wg.Add(1)
			go func() {
				defer wg.Done()
				select {
				case sem <- struct{}{}:
				case <-ctx.Done():
					return
				}
				defer func() { <-sem }()
				h, err := c.fetch(ctx, client, id)
				select {
				case results <- fetched{identity: id, cert: h, err: err}:
				case <-ctx.Done():
				}
			}()
		}
		select {
		case <-ctx.Done():
			return
		case <-stateChanged:
		case <-time.After(certRecheck):
		case r := <-results:
			delete(inflight, r.identity)
			if r.err != nil {
				b := min(max(backoff[r.identity]*2, certRetryFirst), certRetryMax)
				backoff[r.identity] = b
				retryAt[r.identity] = c.cfg.Now().Add(b)
				c.log.Warn("Certificate request failed", "identity", r.identity, "error", r.err, "retryIn", b)
				continue
			}
			delete(backoff, r.identity)
			delete(retryAt, r.identity)
			// A workload may have left while its request ran.
			if c.state.LocalIdentities()[r.identity] {
				c.put(r.identity, r.cert)
				c.log.Info("Certificate held", "identity", r.identity, "notAfter", r.cert.cert.Leaf.NotAfter, "renewAt", r.cert.refreshAt)
			}
		}
	}
}

// due: no certificate yet, or past half its life.
func (c *Certificates) due(id string, now time.Time) bool {
	c.mu.RLock()
	defer c.mu.RUnlock()
	h := c.held[id]
	return h == nil || !now.Before(h.refreshAt)
}

func (c *Certificates) put(id string, h *heldCertificate) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.held[id] = h
	c.rebuildLocked()
}

// drop forgets identities no local workload holds.
func (c *Certificates) drop(want map[string]bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	dropped := false
	for id := range c.held {
		if !want[id] {
			delete(c.held, id)
			dropped = true
			c.log.Info("Certificate dropped: no local workload holds the identity", "identity", id)
		}
	}
	if dropped {
		c.rebuildLocked()
	}
}

func (c *Certificates) rebuildLocked() {
	pool := x509.NewCertPool()
	for _, h := range c.held {
		for _, r := range h.roots {
			pool.AddCert(r)
		}
	}
	c.bundle = pool
	c.metrics.CertificatesHeld.Set(float64(len(c.held)))
	close(c.changed)
	c.changed = make(chan struct{})
}

// fetch asks the CA for a certificate of identity, with a fresh key.
func (c *Certificates) fetch(ctx context.Context, client pb.IstioCertificateServiceClient, identity string) (*heldCertificate, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	csr, err := newCSR(key, identity)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, certRequestTimeout)
	defer cancel()
	resp, err := client.CreateCertificate(ctx, &pb.IstioCertificateRequest{
		Csr:              csr,
		ValidityDuration: int64(c.cfg.CertificateValidity / time.Second),
		Metadata: &structpb.Struct{Fields: map[string]*structpb.Value{
			"ImpersonatedIdentity": structpb.NewStringValue(identity),
		}},
	}, grpc.WaitForReady(false))
	if err != nil {
		c.metrics.CertRequests.WithLabelValues("refused").Inc()
		return nil, err
	}
	h, err := verifyChain(resp.GetCertChain(), key, identity, c.cfg.Now())
	if err != nil {
		c.metrics.CertRequests.WithLabelValues("bad-chain").Inc()
		return nil, err
	}
	c.metrics.CertRequests.WithLabelValues("issued").Inc()
	return h, nil
}

// newCSR makes a PEM CSR with an empty subject and one critical URI SAN,
// as ztunnel's.
func newCSR(key *ecdsa.PrivateKey, identity string) (string, error) {
	u, err := url.Parse(identity)
	if err != nil {
		return "", err
	}
	san, err := asn1.Marshal([]asn1.RawValue{{Tag: 6, Class: asn1.ClassContextSpecific, Bytes: []byte(u.String())}})
	if err != nil {
		return "", err
	}
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{
		ExtraExtensions: []pkix.Extension{{Id: asn1.ObjectIdentifier{2, 5, 29, 17}, Critical: true, Value: san}},
	}, key)
	if err != nil {
		return "", err
	}
	return string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der})), nil
}

// verifyChain checks a CA answer, as ztunnel does and more: a leaf for our
// key with exactly the identity asked as its only SAN, followed by at
// least one root, and the leaf verifying through the intermediates to
// those roots for both client and server use. The roots become part of the
// trust bundle.
func verifyChain(chainPEM []string, key *ecdsa.PrivateKey, identity string, now time.Time) (*heldCertificate, error) {
	var certs []*x509.Certificate
	for _, p := range chainPEM {
		rest := []byte(p)
		for {
			var block *pem.Block
			block, rest = pem.Decode(rest)
			if block == nil {
				break
			}
			crt, err := x509.ParseCertificate(block.Bytes)
			if err != nil {
				return nil, fmt.Errorf("%w: %v", ErrBadChain, err)
			}
			certs = append(certs, crt)
		}
	}
	if len(certs) < 2 {
		return nil, fmt.Errorf("%w: %d certificates, want the leaf and a root", ErrBadChain, len(certs))
	}
	leaf := certs[0]
	if pub, ok := leaf.PublicKey.(*ecdsa.PublicKey); !ok || !pub.Equal(&key.PublicKey) {
		return nil, fmt.Errorf("%w: the leaf is not for the key of the request", ErrBadChain)
	}
	if len(leaf.URIs) != 1 || leaf.URIs[0].String() != identity || len(leaf.DNSNames)+len(leaf.IPAddresses)+len(leaf.EmailAddresses) > 0 {
		return nil, fmt.Errorf("%w: leaf SANs %v %v %v, want only %s", ErrBadChain, leaf.URIs, leaf.DNSNames, leaf.IPAddresses, identity)
	}
	roots, inter := x509.NewCertPool(), x509.NewCertPool()
	var rootList []*x509.Certificate
	for _, crt := range certs[1:] {
		if crt.IsCA && bytes.Equal(crt.RawIssuer, crt.RawSubject) && crt.CheckSignatureFrom(crt) == nil {
			roots.AddCert(crt)
			rootList = append(rootList, crt)
		} else {
			inter.AddCert(crt)
		}
	}
	if len(rootList) == 0 {
		return nil, fmt.Errorf("%w: no root after the leaf", ErrBadChain)
	}
	for _, usage := range []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth, x509.ExtKeyUsageServerAuth} {
		if _, err := leaf.Verify(x509.VerifyOptions{Roots: roots, Intermediates: inter, CurrentTime: now, KeyUsages: []x509.ExtKeyUsage{usage}}); err != nil {
			return nil, fmt.Errorf("%w: %v", ErrBadChain, err)
		}
	}
	der := [][]byte{leaf.Raw}
	for _, crt := range certs[1:] {
		if !slices.Contains(rootList, crt) {
			der = append(der, crt.Raw)
		}
	}
	return &heldCertificate{
		cert:      &tls.Certificate{Certificate: der, PrivateKey: key, Leaf: leaf},
		roots:     rootList,
		refreshAt: leaf.NotBefore.Add(leaf.NotAfter.Sub(leaf.NotBefore) / 2),
	}, nil
}
