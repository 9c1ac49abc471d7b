// SPDX-License-Identifier: Apache-2.0

package identity

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"net/url"
	"testing"
	"time"
)

// BenchmarkSignP256 checks and signs one ECDSA P-256 CSR per operation, the
// work of a CreateCertificate call without the transport; b.N/s is the
// signing rate.
func BenchmarkSignP256(b *testing.B) {
	certPEM, keyPEM, err := NewRootMaterial("cluster.local", time.Hour)
	if err != nil {
		b.Fatal(err)
	}
	m, err := ParseMaterial(certPEM, keyPEM, nil)
	if err != nil {
		b.Fatal(err)
	}
	a := &Authority{}
	a.Set(m, nil)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		b.Fatal(err)
	}
	u, _ := url.Parse("spiffe://cluster.local/ns/app/sa/web")
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{URIs: []*url.URL{u}}, key)
	if err != nil {
		b.Fatal(err)
	}
	csrPEM := string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der}))
	for b.Loop() {
		csr, id, rerr := CheckRequest(csrPEM, nil, "cluster.local")
		if rerr != nil {
			b.Fatal(rerr)
		}
		if _, err := a.SignWorkload(csr, id.String(), time.Hour); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "signatures/s")
}
