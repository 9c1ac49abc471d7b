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

	"google.golang.org/protobuf/types/known/structpb"
)

// FuzzCheckRequest feeds arbitrary CSRs, impersonation metadata and trust
// domains to the request checks. They must never panic, and whatever they
// accept must be exactly what the issue allows: a CSR signed by its key with
// one URI SAN that is a workload ID of the trust domain, matching the
// metadata. Seeds: testdata/fuzz/FuzzCheckRequest and the cases below.
func FuzzCheckRequest(f *testing.F) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		f.Fatal(err)
	}
	csr := func(uris ...string) string {
		tmpl := &x509.CertificateRequest{}
		for _, u := range uris {
			parsed, _ := url.Parse(u)
			tmpl.URIs = append(tmpl.URIs, parsed)
		}
		der, err := x509.CreateCertificateRequest(rand.Reader, tmpl, key)
		if err != nil {
			f.Fatal(err)
		}
		return string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der}))
	}
	f.Add(csr("spiffe://cluster.local/ns/app/sa/web"), "", "cluster.local")
	f.Add(csr("spiffe://cluster.local/identity/7"), "spiffe://cluster.local/identity/7", "cluster.local")
	f.Add(csr("spiffe://cluster.local/ns/app/sa/web", "spiffe://cluster.local/ns/app/sa/db"), "", "cluster.local")
	f.Add(csr("spiffe://other/ns/app/sa/web"), "spiffe://other/ns/app/sa/web", "cluster.local")
	f.Add("-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n", "", "cluster.local")

	f.Fuzz(func(t *testing.T, csrPEM, impersonated, trustDomain string) {
		var meta *structpb.Struct
		if impersonated != "" {
			meta = &structpb.Struct{Fields: map[string]*structpb.Value{impersonatedIdentityKey: structpb.NewStringValue(impersonated)}}
		}
		parsed, id, rerr := CheckRequest(csrPEM, meta, trustDomain)
		if rerr != nil {
			if rerr.Reason == "" || rerr.Message == "" {
				t.Fatalf("refusal without reason or message: %+v", rerr)
			}
			return
		}
		if len(parsed.URIs) != 1 || parsed.URIs[0].String() != id.String() {
			t.Fatalf("accepted SANs %v for identity %s", parsed.URIs, id)
		}
		if id.TrustDomain != trustDomain {
			t.Fatalf("accepted %s outside trust domain %q", id, trustDomain)
		}
		if impersonated != "" && impersonated != id.String() {
			t.Fatalf("accepted %s impersonating %q", id, impersonated)
		}
		if err := parsed.CheckSignature(); err != nil {
			t.Fatalf("accepted a CSR whose signature fails: %v", err)
		}
		if err := checkKey(parsed.PublicKey); err != nil {
			t.Fatalf("accepted a weak key: %v", err)
		}
	})
}
