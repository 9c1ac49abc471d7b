// SPDX-License-Identifier: Apache-2.0

package proxy

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"
)

// tokenCredentials sends ztunnel's caller credentials with every RPC: the
// bearer token, read from its file at each call (projected tokens rotate),
// and the cluster id.
type tokenCredentials struct {
	path      string
	clusterID string
}

// GetRequestMetadata implements credentials.PerRPCCredentials.
func (c tokenCredentials) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	b, err := os.ReadFile(c.path)
	if err != nil {
		return nil, fmt.Errorf("read token %s: %w", c.path, err)
	}
	token := strings.TrimSpace(string(b))
	if token == "" {
		return nil, fmt.Errorf("token file %s is empty", c.path)
	}
	return map[string]string{"authorization": "Bearer " + token, "clusterid": c.clusterID}, nil
}

// RequireTransportSecurity implements credentials.PerRPCCredentials: the
// token never goes out in clear.
func (tokenCredentials) RequireTransportSecurity() bool { return true }

// dialGRPC connects to an https-only gRPC server (the node agent's xDS or
// CA), verifying its certificate against root, read anew at every
// handshake so that a rotated bundle applies without a restart.
func dialGRPC(address string, root RootCA, creds tokenCredentials) (*grpc.ClientConn, error) {
	host, _, err := net.SplitHostPort(address)
	if err != nil {
		return nil, err
	}
	tlsConfig := &tls.Config{
		MinVersion: tls.VersionTLS12,
		ServerName: host,
		// Verification happens in VerifyConnection, with a fresh pool.
		InsecureSkipVerify: true,
		VerifyConnection: func(cs tls.ConnectionState) error {
			pool, err := root.Pool()
			if err != nil {
				return fmt.Errorf("trust bundle %s: %w", root, err)
			}
			if len(cs.PeerCertificates) == 0 {
				return errors.New("server sent no certificate")
			}
			inter := x509.NewCertPool()
			for _, c := range cs.PeerCertificates[1:] {
				inter.AddCert(c)
			}
			_, err = cs.PeerCertificates[0].Verify(x509.VerifyOptions{
				Roots: pool, Intermediates: inter, DNSName: host,
				KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
			})
			return err
		},
	}
	return grpc.NewClient(address,
		grpc.WithTransportCredentials(credentials.NewTLS(tlsConfig)),
		grpc.WithPerRPCCredentials(creds),
		// As istiod expects of ztunnel: pings at most every 30 s.
		grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: 30 * time.Second, Timeout: 10 * time.Second, PermitWithoutStream: true}),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(16<<20)),
	)
}
