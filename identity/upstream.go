// SPDX-License-Identifier: Apache-2.0

package identity

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/structpb"
	pb "istio.io/api/security/v1alpha1"
)

// upstream is the signer a node agent forwards certificate requests to
// (--ca-upstream): the node holds no CA key, so root on a node obtains the
// identities of its own node's pods and no others.
type upstream struct {
	client pb.IstioCertificateServiceClient
	conn   *grpc.ClientConn
	// tokenFile is re-read for every request: the kubelet renews it.
	tokenFile string
}

// upstreamTimeout bounds one forwarded request.
const upstreamTimeout = 10 * time.Second

func newUpstream(cfg Config) (*upstream, error) {
	host, _, err := net.SplitHostPort(cfg.CAUpstream)
	if err != nil {
		return nil, fmt.Errorf("--ca-upstream=%q: %w", cfg.CAUpstream, err)
	}
	if cfg.CAUpstreamRoots == "" || cfg.CAUpstreamTokenFile == "" {
		return nil, errors.New("--ca-upstream needs --ca-upstream-roots and --ca-upstream-token-file")
	}
	// The roots are read at every handshake, so that a root rotation
	// (the file is a mounted ConfigMap) needs no restart.
	tlsConfig := &tls.Config{
		MinVersion:         tls.VersionTLS12,
		InsecureSkipVerify: true, // verified below, against the roots as they are now
		VerifyConnection: func(cs tls.ConnectionState) error {
			roots, err := os.ReadFile(cfg.CAUpstreamRoots)
			if err != nil {
				return fmt.Errorf("--ca-upstream-roots: %w", err)
			}
			pool := x509.NewCertPool()
			if !pool.AppendCertsFromPEM(roots) {
				return fmt.Errorf("--ca-upstream-roots %s: no PEM certificate", cfg.CAUpstreamRoots)
			}
			if len(cs.PeerCertificates) == 0 {
				return errors.New("the signer sent no certificate")
			}
			intermediates := x509.NewCertPool()
			for _, c := range cs.PeerCertificates[1:] {
				intermediates.AddCert(c)
			}
			_, err = cs.PeerCertificates[0].Verify(x509.VerifyOptions{DNSName: host, Roots: pool, Intermediates: intermediates})
			return err
		},
	}
	conn, err := grpc.NewClient(cfg.CAUpstream, grpc.WithTransportCredentials(credentials.NewTLS(tlsConfig)))
	if err != nil {
		return nil, fmt.Errorf("--ca-upstream=%q: %w", cfg.CAUpstream, err)
	}
	return &upstream{client: pb.NewIstioCertificateServiceClient(conn), conn: conn, tokenFile: cfg.CAUpstreamTokenFile}, nil
}

// sign asks the signer for a certificate of id for the CSR's key, as this
// node's agent, and checks the answer: a leaf for that key with id as its
// only URI SAN, then the roots.
func (u *upstream) sign(ctx context.Context, csrPEM string, csr *x509.CertificateRequest, id string, ttl time.Duration) (*Issued, error) {
	token, err := os.ReadFile(u.tokenFile)
	if err != nil {
		return nil, fmt.Errorf("--ca-upstream-token-file: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, upstreamTimeout)
	defer cancel()
	ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+strings.TrimSpace(string(token)))
	resp, err := u.client.CreateCertificate(ctx, &pb.IstioCertificateRequest{
		Csr:              csrPEM,
		ValidityDuration: int64(ttl / time.Second),
		Metadata: &structpb.Struct{Fields: map[string]*structpb.Value{
			impersonatedIdentityKey: structpb.NewStringValue(id),
		}},
	})
	if err != nil {
		return nil, err
	}
	chain := resp.GetCertChain()
	if len(chain) < 2 {
		return nil, fmt.Errorf("the signer answered %d chain elements, want the leaf and the roots", len(chain))
	}
	block, _ := pem.Decode([]byte(chain[0]))
	if block == nil {
		return nil, errors.New("the signer's leaf is not PEM")
	}
	leaf, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		return nil, fmt.Errorf("the signer's leaf: %w", err)
	}
	if len(leaf.URIs) != 1 || leaf.URIs[0].String() != id {
		return nil, fmt.Errorf("the signer's leaf names %v, want %s", leaf.URIs, id)
	}
	if !publicKeysEqual(leaf.PublicKey, csr.PublicKey) {
		return nil, errors.New("the signer's leaf is not for the requested key")
	}
	return &Issued{Leaf: leaf, ChainPEM: chain}, nil
}
