// SPDX-License-Identifier: Apache-2.0

package nodeagent

import "github.com/prometheus/client_golang/prometheus"

// Metrics of the ZDS server.
type Metrics struct {
	// Requests counts requests sent, by type (add, keep, del,
	// snapshot_sent) and outcome (acked, nacked, failed: the connection
	// lost, or unsendable).
	Requests *prometheus.CounterVec
	// Connections is the number of ztunnel connections after hello.
	Connections prometheus.Gauge
}

// NewMetrics creates the metrics and registers them with reg (nil: not
// registered).
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		Requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mtlsbridge_zds_requests_total",
			Help: "ZDS requests sent to ztunnel, by type and outcome (acked, nacked, failed)",
		}, []string{"type", "outcome"}),
		Connections: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "mtlsbridge_zds_connections",
			Help: "ztunnel connections on the ZDS socket",
		}),
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{m.Requests, m.Connections} {
			if err := reg.Register(c); err != nil {
				return nil, err
			}
		}
	}
	return m, nil
}
