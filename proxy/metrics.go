// SPDX-License-Identifier: Apache-2.0

package proxy

import "github.com/prometheus/client_golang/prometheus"

// Label values of the connection metrics.
const (
	DirectionInbound  = "inbound"  // accepted on 15008 from a peer proxy (in-pod: also 15006, plain)
	DirectionOutbound = "outbound" // captured from a local pod on 15001
	ProtocolHBONE     = "hbone"
	ProtocolPlain     = "plain"
)

// Metrics of the proxy, served on /metrics (port 15020).
type Metrics struct {
	// ConnectionsOpened and ConnectionsClosed count proxied connections
	// that reached their destination, by direction and protocol.
	ConnectionsOpened *prometheus.CounterVec
	ConnectionsClosed *prometheus.CounterVec
	// SentBytes are bytes from the source to the destination, ReceivedBytes
	// the other way (as ztunnel's istio_tcp_sent/received_bytes_total).
	SentBytes     *prometheus.CounterVec
	ReceivedBytes *prometheus.CounterVec
	// Refused counts connections the proxy refused or could not complete,
	// by direction and reason; each also logs one line with both identities.
	Refused *prometheus.CounterVec
	// HandshakeFailures counts failed TLS handshakes by direction and
	// reason (a subset of Refused).
	HandshakeFailures *prometheus.CounterVec

	// TunnelsDialed counts HBONE connections made (tunnels share them).
	TunnelsDialed prometheus.Counter

	XDSConnects  prometheus.Counter
	XDSResponses *prometheus.CounterVec
	XDSNACKs     *prometheus.CounterVec
	Workloads    prometheus.Gauge
	Policies     prometheus.Gauge

	CertificatesHeld prometheus.Gauge
	CertRequests     *prometheus.CounterVec

	// In-pod mode: ZDS connections made, and pods served (listeners open
	// in their namespace).
	ZDSConnects prometheus.Counter
	InPodPods   prometheus.Gauge
}

// NewMetrics creates the metrics and registers them with reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	conn := []string{"direction", "protocol"}
	m := &Metrics{
		ConnectionsOpened: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mtlsbridge_proxy_connections_opened_total",
			Help: "Proxied connections opened to their destination, by direction and protocol",
		}, conn),
		ConnectionsClosed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mtlsbridge_proxy_connections_closed_total",
			Help: "Proxied connections closed, by direction and protocol",
		}, conn),
		SentBytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mtlsbridge_proxy_sent_bytes_total",
			Help: "Bytes proxied from source to destination, by direction and protocol",
		}, conn),
		ReceivedBytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mtlsbridge_proxy_received_bytes_total",
			Help: "Bytes proxied from destination back to source, by direction and protocol",
		}, conn),
		Refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mtlsbridge_proxy_connections_refused_total",
			Help: "Connections refused or failed before data flowed, by direction and reason",
		}, []string{"direction", "reason"}),
		HandshakeFailures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mtlsbridge_proxy_handshake_failures_total",
			Help: "TLS handshakes that failed, by direction and reason",
		}, []string{"direction", "reason"}),
		TunnelsDialed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "mtlsbridge_proxy_hbone_connections_dialed_total",
			Help: "HBONE connections made to peers (tunnels are streams on them)",
		}),
		XDSConnects: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "mtlsbridge_proxy_xds_connects_total",
			Help: "xDS streams opened (the first and every reconnection)",
		}),
		XDSResponses: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mtlsbridge_proxy_xds_responses_total",
			Help: "xDS responses received, by type",
		}, []string{"type"}),
		XDSNACKs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mtlsbridge_proxy_xds_nacks_total",
			Help: "xDS responses NACKed (at least one resource rejected), by type",
		}, []string{"type"}),
		Workloads: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "mtlsbridge_proxy_workloads",
			Help: "Workloads known through xDS",
		}),
		Policies: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "mtlsbridge_proxy_authorizations",
			Help: "Authorization policies known through xDS",
		}),
		CertificatesHeld: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "mtlsbridge_proxy_certificates",
			Help: "Workload certificates held (one per local identity)",
		}),
		CertRequests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mtlsbridge_proxy_certificate_requests_total",
			Help: "CreateCertificate calls, by result (issued, refused, bad-chain, error)",
		}, []string{"result"}),
		ZDSConnects: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "mtlsbridge_proxy_zds_connects_total",
			Help: "In-pod mode: ZDS connections to the node agent (the first and every reconnection)",
		}),
		InPodPods: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "mtlsbridge_proxy_inpod_pods",
			Help: "In-pod mode: pods served, with listeners in their network namespace",
		}),
	}
	reg.MustRegister(m.ConnectionsOpened, m.ConnectionsClosed, m.SentBytes, m.ReceivedBytes, m.Refused,
		m.HandshakeFailures, m.TunnelsDialed, m.XDSConnects, m.XDSResponses, m.XDSNACKs, m.Workloads, m.Policies,
		m.CertificatesHeld, m.CertRequests, m.ZDSConnects, m.InPodPods)
	return m
}
