// SPDX-License-Identifier: Apache-2.0

package grpcserver

import "github.com/prometheus/client_golang/prometheus"

// Metrics of the gRPC listener.
type Metrics struct {
	// AuthRefused counts callers refused, by reason.
	AuthRefused *prometheus.CounterVec
	// ConnectionsRefused counts connections closed at once because their
	// pool (agents, others) was full or their address held its share.
	ConnectionsRefused *prometheus.CounterVec
}

func newMetrics(reg *prometheus.Registry) *Metrics {
	m := &Metrics{
		AuthRefused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mtlsbridge_grpc_auth_refused_total",
			Help: "gRPC callers refused, by reason",
		}, []string{"reason"}),
		ConnectionsRefused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mtlsbridge_grpc_connections_refused_total",
			Help: "gRPC connections closed at once, by pool: agents (this node's mTLS agent pods) or others full, or address (one address held its share of others)",
		}, []string{"pool"}),
	}
	reg.MustRegister(m.AuthRefused, m.ConnectionsRefused)
	return m
}
