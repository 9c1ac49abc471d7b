// SPDX-License-Identifier: Apache-2.0

// Package grpcserver runs the TLS gRPC listener the node's mTLS agent talks
// to (delta xDS and the certificate authority) and authenticates its
// callers: only this node's mTLS agent pod gets an answer. In the signer,
// its callers are node agents instead (NodeAgentCallersCell).
package grpcserver

import (
	"fmt"
	"net"
	"slices"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/spf13/pflag"
	"google.golang.org/grpc"
)

// Cell serves the registered gRPC services and provides the authenticator.
var Cell = cell.Module(
	"grpc",
	"TLS gRPC listener for the mTLS agent",

	cell.Config(defaultConfig),
	// Services (xDS, CA) authenticate their callers with it.
	cell.Provide(newAuthenticator),
	// Counts refused callers by reason.
	cell.Provide(newMetrics),
	// Readiness: token reviews work (Kubernetes mode), or a warning that no
	// caller can authenticate (folder mode without --token-file).
	cell.Provide(readinessCheck),
	cell.Invoke(registerReviewProbe),
	// The listener; tests ask it for its address.
	cell.Provide(newServer),
	cell.Invoke(func(*Server) {}),
)

// Config of the listener and of caller authentication.
type Config struct {
	// GRPCListen is the host:port of the listener (flag --grpc-listen).
	GRPCListen string
	// GRPCCert and GRPCKey are the serving certificate and key files; when
	// empty the project's CA issues the serving certificate.
	GRPCCert string
	GRPCKey  string
	// GRPCServingNames are more DNS names for the certificate the CA
	// issues: the signer's Service.
	GRPCServingNames []string
	// TokenFile holds "TOKEN NAMESPACE/POD" lines: the callers of the
	// manifest-folder mode. Kubernetes mode uses TokenReview instead.
	TokenFile string
	// TokenAudiences are the audiences a TokenReview accepts (ztunnel's
	// default token audience is istio-ca).
	TokenAudiences []string
	// GRPCMaxMessageBytes bounds a received and a sent message.
	GRPCMaxMessageBytes int
	// GRPCMaxConnections bounds the connections served at once, beside
	// those of this node's mTLS agent pods (agentConnections).
	GRPCMaxConnections int
	// TokenReviewQPS and TokenReviewBurst are the budget of TokenReviews.
	TokenReviewQPS   float64
	TokenReviewBurst int
}

var defaultConfig = Config{
	GRPCListen:          "127.0.0.1:15012",
	TokenAudiences:      []string{"istio-ca"},
	GRPCMaxMessageBytes: 16 << 20,
	GRPCMaxConnections:  64,
	TokenReviewQPS:      5,
	TokenReviewBurst:    10,
}

// Flags implements cell.Flagger.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.String("grpc-listen", def.GRPCListen, "host:port of the TLS gRPC listener (xDS and CA) for the mTLS agent")
	flags.String("grpc-cert", def.GRPCCert, "Serving certificate (PEM) of the gRPC listener; default: issued by the mtlsbridge CA")
	flags.String("grpc-key", def.GRPCKey, "Private key (PEM) of --grpc-cert")
	flags.StringSlice("grpc-serving-names", def.GRPCServingNames, "More DNS names in the serving certificate the CA issues (the signer's Service name)")
	flags.String("token-file", def.TokenFile, `Folder mode: file of "TOKEN NAMESPACE/POD" lines naming the callers' pods`)
	flags.StringSlice("token-audiences", def.TokenAudiences, "Kubernetes mode: audiences accepted in TokenReview")
	flags.Int("grpc-max-message-bytes", def.GRPCMaxMessageBytes, "Largest gRPC message received or sent (xDS reconnects carry every held resource name)")
	flags.Int("grpc-max-connections", def.GRPCMaxConnections, "Connections the gRPC listener serves at once")
	flags.Float64("token-review-qps", def.TokenReviewQPS, "Kubernetes mode: TokenReviews per second at most (own budget, beside --kube-api-qps)")
	flags.Int("token-review-burst", def.TokenReviewBurst, "Kubernetes mode: TokenReviews in a burst at most")
}

func (c Config) validate() error {
	if _, _, err := net.SplitHostPort(c.GRPCListen); err != nil {
		return fmt.Errorf("--grpc-listen=%q: %w", c.GRPCListen, err)
	}
	if (c.GRPCCert == "") != (c.GRPCKey == "") {
		return fmt.Errorf("--grpc-cert and --grpc-key go together")
	}
	if c.GRPCMaxMessageBytes < 1<<16 {
		return fmt.Errorf("--grpc-max-message-bytes=%d: want at least 65536", c.GRPCMaxMessageBytes)
	}
	if c.GRPCMaxConnections < 1 {
		return fmt.Errorf("--grpc-max-connections=%d: want at least 1", c.GRPCMaxConnections)
	}
	if slices.Contains(c.TokenAudiences, "") || len(c.TokenAudiences) == 0 {
		// Without an audience, TokenReview accepts tokens meant for the
		// API server itself: any token the agent pod can read.
		return fmt.Errorf("--token-audiences: want at least one, none empty (ztunnel's: istio-ca)")
	}
	if c.TokenReviewQPS <= 0 || c.TokenReviewBurst < 1 {
		return fmt.Errorf("--token-review-qps and --token-review-burst must be positive")
	}
	return nil
}

// Service registers a gRPC service on the server.
type Service func(*grpc.Server)

// ServiceOut adds a Service to the server.
type ServiceOut struct {
	cell.Out

	Service Service `group:"grpc-services"`
}

// Keepalive as istiod does it: clients may ping every 15 s; the server pings
// idle connections every 30 s and drops them after 10 s without an answer.
const (
	keepaliveMinTime = 15 * time.Second
	keepaliveTime    = 30 * time.Second
	keepaliveTimeout = 10 * time.Second
)
