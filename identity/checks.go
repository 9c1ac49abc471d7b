// SPDX-License-Identifier: Apache-2.0

package identity

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rsa"
	"crypto/x509"
	"encoding/pem"
	"fmt"

	"google.golang.org/protobuf/types/known/structpb"

	"github.com/mtlsbridge/mtlsbridge/spiffe"
)

// Reasons a certificate request is refused, as counted in
// mtlsbridge_ca_requests_refused_total.
const (
	ReasonMalformedCSR          = "malformed-csr"
	ReasonBadSignature          = "bad-signature"
	ReasonSANs                  = "not-exactly-one-uri-san"
	ReasonNotSPIFFE             = "not-spiffe-id"
	ReasonTrustDomain           = "wrong-trust-domain"
	ReasonWeakKey               = "weak-key"
	ReasonImpersonationMismatch = "impersonation-mismatch"
	ReasonNotOnThisNode         = "identity-not-on-this-node"
	ReasonNotEnrolled           = "identity-not-enrolled"
	ReasonReservedIdentity      = "reserved-identity"
	ReasonIdentityScheme        = "identity-scheme-not-signed"
	ReasonNoServiceAccount      = "pod-without-service-account"
)

// RequestError is a refused request: the reason label and what to tell the
// caller.
type RequestError struct {
	Reason  string
	Message string
}

func (e *RequestError) Error() string { return e.Reason + ": " + e.Message }

func refuse(reason, format string, args ...any) *RequestError {
	return &RequestError{Reason: reason, Message: fmt.Sprintf(format, args...)}
}

// impersonatedIdentityKey is the metadata field ztunnel sets when it asks on
// behalf of a workload.
const impersonatedIdentityKey = "ImpersonatedIdentity"

// CheckRequest validates a certificate request independently of who asks:
// a well-formed CSR signed by its key, with exactly one URI SAN (and no other
// SAN) that is a workload SPIFFE ID of trustDomain, an allowed key (ECDSA
// P-256/P-384, RSA of 2048 bits or more), and ImpersonatedIdentity metadata,
// when present, equal to the SAN.
func CheckRequest(csrPEM string, metadata *structpb.Struct, trustDomain string) (*x509.CertificateRequest, spiffe.ID, *RequestError) {
	block, _ := pem.Decode([]byte(csrPEM))
	if block == nil || block.Type != "CERTIFICATE REQUEST" {
		return nil, spiffe.ID{}, refuse(ReasonMalformedCSR, "csr is not a PEM CERTIFICATE REQUEST")
	}
	csr, err := x509.ParseCertificateRequest(block.Bytes)
	if err != nil {
		return nil, spiffe.ID{}, refuse(ReasonMalformedCSR, "csr does not parse: %v", err)
	}
	if err := csr.CheckSignature(); err != nil {
		return nil, spiffe.ID{}, refuse(ReasonBadSignature, "csr signature does not verify with its key: %v", err)
	}
	if len(csr.URIs) != 1 || len(csr.DNSNames)+len(csr.IPAddresses)+len(csr.EmailAddresses) > 0 {
		return nil, spiffe.ID{}, refuse(ReasonSANs, "csr has %d URI SANs and %d other SANs, want exactly one URI SAN",
			len(csr.URIs), len(csr.DNSNames)+len(csr.IPAddresses)+len(csr.EmailAddresses))
	}
	san := csr.URIs[0].String()
	id, err := spiffe.ParseID(san)
	if err != nil {
		return nil, spiffe.ID{}, refuse(ReasonNotSPIFFE, "%v", err)
	}
	if id.TrustDomain != trustDomain {
		return nil, spiffe.ID{}, refuse(ReasonTrustDomain, "%s is not in trust domain %q", san, trustDomain)
	}
	if id.CiliumIdentity != 0 && id.CiliumIdentity < spiffe.MinimalPodIdentity {
		// A certificate for one would let its holder pass for the node.
		return nil, spiffe.ID{}, refuse(ReasonReservedIdentity, "%s is a reserved Cilium identity (below %d), never a pod's", san, spiffe.MinimalPodIdentity)
	}
	if err := checkKey(csr.PublicKey); err != nil {
		return nil, spiffe.ID{}, refuse(ReasonWeakKey, "%v", err)
	}
	if metadata != nil {
		if v, ok := metadata.GetFields()[impersonatedIdentityKey]; ok && v.GetStringValue() != san {
			return nil, spiffe.ID{}, refuse(ReasonImpersonationMismatch, "ImpersonatedIdentity %q differs from the csr's SAN %s", v.GetStringValue(), san)
		}
	}
	return csr, id, nil
}

func checkKey(pub any) error {
	switch k := pub.(type) {
	case *ecdsa.PublicKey:
		if k.Curve == elliptic.P256() || k.Curve == elliptic.P384() {
			return nil
		}
		return fmt.Errorf("ECDSA curve %s not allowed (want P-256 or P-384)", k.Curve.Params().Name)
	case *rsa.PublicKey:
		if k.N.BitLen() >= 2048 {
			return nil
		}
		return fmt.Errorf("RSA key of %d bits, want at least 2048", k.N.BitLen())
	}
	return fmt.Errorf("key type %T not allowed (want ECDSA P-256/P-384 or RSA >= 2048)", pub)
}
