// SPDX-License-Identifier: Apache-2.0

package identity

import (
	"testing"
	"time"
)

// BenchmarkSignP256 checks and signs one ECDSA P-256 CSR per operation, the
// work of a CreateCertificate call without the transport; b.N/s is the
// signing rate.
func BenchmarkSignP256(b *testing.B) {
	a, _ := newTestAuthority(b)
	csrPEM, _ := newCSR(b, "spiffe://cluster.local/ns/app/sa/web")
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
