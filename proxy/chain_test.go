// SPDX-License-Identifier: Apache-2.0

package proxy

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"testing"
	"time"

	"github.com/mtlsbridge/mtlsbridge/identity"
)

// TestVerifyChain: a CA answer is used only when its leaf is for the key
// and exactly the identity asked, and chains to a root that follows it.
func TestVerifyChain(t *testing.T) {
	ca := newAuthority(t)
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	other, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	sign := func(k *ecdsa.PrivateKey, id string) []string { return signWith(t, ca, k, id) }
	good := sign(key, hbWebID)
	foreign := signWith(t, newAuthority(t), key, hbWebID)
	h, err := verifyChain(good, key, hbWebID, time.Now())

	must(t, err)
	if h.cert.Leaf.URIs[0].String() != hbWebID || len(h.roots) != 1 || len(h.cert.Certificate) != 1 {
		t.Errorf("held %v with %d roots, %d certificates sent", h.cert.Leaf.URIs, len(h.roots), len(h.cert.Certificate))
	}
	if half := h.cert.Leaf.NotBefore.Add(h.cert.Leaf.NotAfter.Sub(h.cert.Leaf.NotBefore) / 2); !h.refreshAt.Equal(half) {
		t.Errorf("renewal at %s, want half life %s", h.refreshAt, half)
	}
	for name, c := range map[string]struct {
		chain []string
		key   *ecdsa.PrivateKey
		id    string
		at    time.Time
	}{
		"another identity":  {sign(key, hbAPIID), key, hbWebID, time.Now()},
		"another key":       {good, other, hbWebID, time.Now()},
		"no root":           {good[:1], key, hbWebID, time.Now()},
		"a foreign root":    {append(good[:1:1], foreign[1:]...), key, hbWebID, time.Now()},
		"expired":           {good, key, hbWebID, time.Now().Add(2 * time.Hour)},
		"not a certificate": {[]string{"junk", "junk"}, key, hbWebID, time.Now()},
	} {
		if _, err := verifyChain(c.chain, c.key, c.id, c.at); !errors.Is(err, ErrBadChain) {
			t.Errorf("%s: %v, want ErrBadChain", name, err)
		}
	}
}

// signWith has ca sign a CSR of key (one URI SAN) for id.
func signWith(t *testing.T, ca *identity.Authority, key *ecdsa.PrivateKey, id string) []string {
	csrPEM, err := newCSR(key, hbWebID)
	must(t, err)
	block, _ := pem.Decode([]byte(csrPEM))
	csr, err := x509.ParseCertificateRequest(block.Bytes)
	must(t, err)
	if len(csr.URIs) != 1 || csr.URIs[0].String() != hbWebID {
		t.Fatalf("CSR SANs %v", csr.URIs)
	}
	issued, err := ca.SignWorkload(csr, id, time.Hour)
	must(t, err)
	return issued.ChainPEM
}
