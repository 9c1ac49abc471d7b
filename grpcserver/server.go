// SPDX-License-Identifier: Apache-2.0

package grpcserver

import (
	"context"
	"crypto/tls"
	"fmt"
	"log/slog"
	"net"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"
)

// ServingCertSource issues the listener's certificate when no files are
// given (the project's CA provides it).
type ServingCertSource interface {
	// ServingCertificate returns a current certificate valid for hosts.
	ServingCertificate(hosts []string) (*tls.Certificate, error)
}

// Server is the running listener.
type Server struct {
	listening chan struct{}
	addr      net.Addr
}

// Addr waits until the listener is open and returns its address (useful
// with --grpc-listen=127.0.0.1:0).
func (s *Server) Addr(ctx context.Context) (net.Addr, error) {
	select {
	case <-s.listening:
		return s.addr, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

type serverParams struct {
	cell.In

	Config   Config
	Log      *slog.Logger
	Jobs     job.Registry
	Health   cell.Health
	Auth     *Authenticator
	Services []Service         `group:"grpc-services"`
	Certs    ServingCertSource `optional:"true"`
}

// Bounds on what a connection may hold before its caller is known.
const (
	// maxConcurrentStreams bounds what one connection can open.
	maxConcurrentStreams = 64
	// handshakeTimeout bounds the TLS handshake of a new connection.
	handshakeTimeout = 10 * time.Second
	// maxIdle closes a connection without a stream for this long: a
	// stranger's connections, whose every stream is refused, do not stay.
	maxIdle = 2 * time.Minute
	// maxHeaderListBytes bounds a stream's headers, which are read whole
	// before the caller is known (gRPC's default, 16 MiB, let a stranger
	// make each connection hold that much with one unfinished header
	// block). A caller sends a service account token (1-2 KiB) and a few
	// short fields.
	maxHeaderListBytes = 32 << 10
)

func newServer(p serverParams) (*Server, error) {
	if err := p.Config.validate(); err != nil {
		return nil, err
	}
	tlsConfig, err := serverTLS(p.Config, p.Certs)
	if err != nil {
		return nil, err
	}
	srv := grpc.NewServer(
		grpc.Creds(credentials.NewTLS(tlsConfig)),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: keepaliveMinTime, PermitWithoutStream: true}),
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: keepaliveTime, Timeout: keepaliveTimeout, MaxConnectionIdle: maxIdle}),
		// Callers are authenticated from a stream's headers, before any
		// of its messages is read.
		grpc.InTapHandle(p.Auth.Tap),
		grpc.ConnectionTimeout(handshakeTimeout),
		grpc.MaxRecvMsgSize(p.Config.GRPCMaxMessageBytes),
		grpc.MaxSendMsgSize(p.Config.GRPCMaxMessageBytes),
		grpc.MaxConcurrentStreams(maxConcurrentStreams),
		grpc.MaxHeaderListSize(maxHeaderListBytes),
		CodecOption(),
	)
	for _, register := range p.Services {
		register(srv)
	}

	s := &Server{listening: make(chan struct{})}
	p.Jobs.NewGroup(p.Health).Add(job.OneShot("serve", func(ctx context.Context, health cell.Health) error {
		l, err := (&net.ListenConfig{}).Listen(ctx, "tcp", p.Config.GRPCListen)
		if err != nil {
			return fmt.Errorf("--grpc-listen: %w", err)
		}
		s.addr = l.Addr()
		l = newPooledListener(l, p.Config.GRPCMaxConnections, p.Auth.isLocalAgent, func(pool string) {
			p.Auth.metrics.ConnectionsRefused.WithLabelValues(pool).Inc()
		})
		close(s.listening)
		p.Log.Info("Serving gRPC for the mTLS agent", "address", l.Addr().String())
		health.OK("serving on " + l.Addr().String())
		go func() {
			<-ctx.Done()
			stopped := make(chan struct{})
			go func() { srv.GracefulStop(); close(stopped) }()
			select {
			case <-stopped:
			case <-time.After(5 * time.Second):
				srv.Stop()
			}
		}()
		return srv.Serve(l)
	}))
	return s, nil
}

// serverTLS serves the files given, or certificates of the project's CA
// for the listen host (and localhost), renewed as the CA sees fit.
func serverTLS(cfg Config, certs ServingCertSource) (*tls.Config, error) {
	tlsConfig := &tls.Config{MinVersion: tls.VersionTLS12, NextProtos: []string{"h2"}}
	if cfg.GRPCCert != "" {
		pair, err := tls.LoadX509KeyPair(cfg.GRPCCert, cfg.GRPCKey)
		if err != nil {
			return nil, fmt.Errorf("--grpc-cert/--grpc-key: %w", err)
		}
		tlsConfig.Certificates = []tls.Certificate{pair}
		return tlsConfig, nil
	}
	if certs == nil {
		return nil, fmt.Errorf("no --grpc-cert/--grpc-key and no CA to issue a serving certificate")
	}
	host, _, _ := net.SplitHostPort(cfg.GRPCListen)
	hosts := []string{"localhost"}
	if host != "" && host != "localhost" {
		hosts = append(hosts, host)
	}
	hosts = append(hosts, cfg.GRPCServingNames...)
	tlsConfig.GetCertificate = func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
		return certs.ServingCertificate(hosts)
	}
	return tlsConfig, nil
}
