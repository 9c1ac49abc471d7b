// SPDX-License-Identifier: Apache-2.0

package grpcserver

import "github.com/prometheus/client_golang/prometheus"

// Metrics of the gRPC listener.
type Metrics struct {
	// AuthRefused counts callers refused, by reason.
	AuthRefused *prometheus.CounterVec
}

func newMetrics(reg *prometheus.Registry) *Metrics {
	m := &Metrics{
		AuthRefused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mtlsbridge_grpc_auth_refused_total",
			Help: "gRPC callers refused, by reason",
		}, []string{"reason"}),
	}
	reg.MustRegister(m.AuthRefused)
	return m
}
