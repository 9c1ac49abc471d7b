// SPDX-License-Identifier: Apache-2.0

package proxy

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"

	"github.com/mtlsbridge/mtlsbridge/spiffe"
)

// alpnH2 is HBONE's only protocol.
const alpnH2 = "h2"

// peerIdentity verifies a peer's certificate chain against bundle for
// usage and returns its workload identity: exactly one URI SAN, a SPIFFE ID
// of trustDomain. Anything else is ErrPeerCertificate.
func peerIdentity(rawCerts [][]byte, bundle *x509.CertPool, trustDomain string, usage x509.ExtKeyUsage) (string, error) {
	if len(rawCerts) == 0 {
		return "", fmt.Errorf("%w: no certificate", ErrPeerCertificate)
	}
	certs := make([]*x509.Certificate, 0, len(rawCerts))
	for _, raw := range rawCerts {
		c, err := x509.ParseCertificate(raw)
		if err != nil {
			return "", fmt.Errorf("%w: %v", ErrPeerCertificate, err)
		}
		certs = append(certs, c)
	}
	inter := x509.NewCertPool()
	for _, c := range certs[1:] {
		inter.AddCert(c)
	}
	leaf := certs[0]
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: bundle, Intermediates: inter, KeyUsages: []x509.ExtKeyUsage{usage}}); err != nil {
		return "", fmt.Errorf("%w: %v", ErrPeerCertificate, err)
	}
	if len(leaf.URIs) != 1 {
		return "", fmt.Errorf("%w: %d URI SANs, want one", ErrPeerCertificate, len(leaf.URIs))
	}
	id, err := spiffe.ParseID(leaf.URIs[0].String())
	if err != nil {
		return "", fmt.Errorf("%w: %v", ErrPeerCertificate, err)
	}
	if id.TrustDomain != trustDomain {
		return "", fmt.Errorf("%w: trust domain %q, want %q", ErrPeerCertificate, id.TrustDomain, trustDomain)
	}
	return id.String(), nil
}

// clientTLS is the TLS of an outbound HBONE connection: TLS 1.3 and h2
// only, the source workload's certificate, and a server that must prove
// the destination workload's identity through the trust bundle. The
// identity the server proved is written to *proved.
func clientTLS(cert *tls.Certificate, bundle *x509.CertPool, trustDomain, want string, proved *string) *tls.Config {
	return &tls.Config{
		MinVersion:   tls.VersionTLS13,
		NextProtos:   []string{alpnH2},
		Certificates: []tls.Certificate{*cert},
		// The server is checked by identity, not by host name: the
		// standard verification is replaced, not skipped.
		InsecureSkipVerify: true,
		VerifyPeerCertificate: func(raw [][]byte, _ [][]*x509.Certificate) error {
			id, err := peerIdentity(raw, bundle, trustDomain, x509.ExtKeyUsageServerAuth)
			if err != nil {
				return err
			}
			*proved = id
			if id != want {
				return fmt.Errorf("%w: server is %s, want %s", ErrPeerIdentity, id, want)
			}
			return nil
		},
		VerifyConnection: func(cs tls.ConnectionState) error {
			if cs.NegotiatedProtocol != alpnH2 {
				return fmt.Errorf("%w: ALPN %q, want h2", ErrPeerCertificate, cs.NegotiatedProtocol)
			}
			return nil
		},
	}
}

// serverTLS is the TLS of the HBONE listener for one connection: the
// certificate of the destination workload the connection is addressed to
// (cert looks it up at the handshake, so a renewed one is used), and a
// client certificate of the trust domain required and verified against
// the bundle of the moment. The identity the client proved is written to
// *proved. No session tickets: every connection proves its identity anew.
func serverTLS(cert func() (*tls.Certificate, error), bundle func() *x509.CertPool, trustDomain string, proved *string) *tls.Config {
	return &tls.Config{
		MinVersion:             tls.VersionTLS13,
		NextProtos:             []string{alpnH2},
		SessionTicketsDisabled: true,
		// Requested, and required by VerifyPeerCertificate, which Go
		// calls without certificates too: a missing one is refused with
		// the same error (and metric reason) as a bad one.
		ClientAuth:     tls.RequestClientCert,
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) { return cert() },
		VerifyPeerCertificate: func(raw [][]byte, _ [][]*x509.Certificate) error {
			id, err := peerIdentity(raw, bundle(), trustDomain, x509.ExtKeyUsageClientAuth)
			if err != nil {
				return err
			}
			*proved = id
			return nil
		},
	}
}
