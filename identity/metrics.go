// SPDX-License-Identifier: Apache-2.0

package identity

import "github.com/prometheus/client_golang/prometheus"

// Metrics of the certificate authority.
type Metrics struct {
	Issued  prometheus.Counter
	Refused *prometheus.CounterVec
}

func newMetrics(reg *prometheus.Registry) *Metrics {
	m := &Metrics{
		Issued: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "mtlsbridge_ca_certificates_issued_total",
			Help: "Workload certificates issued",
		}),
		Refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mtlsbridge_ca_requests_refused_total",
			Help: "Certificate requests refused, by reason",
		}, []string{"reason"}),
	}
	reg.MustRegister(m.Issued, m.Refused)
	return m
}
