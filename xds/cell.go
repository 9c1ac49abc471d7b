// SPDX-License-Identifier: Apache-2.0

// Package xds serves ztunnel's Workload API to the node's mTLS agent over
// delta ADS: istio.workload.Address (a Workload per enrolled pod) and
// istio.security.Authorization. Each stream follows the workloads table
// with its own change iterator, so pushes are exactly the deltas.
package xds

import (
	"fmt"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/pflag"
)

// Cell serves delta xDS on the gRPC listener.
var Cell = cell.Module(
	"xds",
	"Delta xDS Workload API for the mTLS agent",

	cell.Config(defaultConfig),
	// One row per stream, written only by the streams.
	cell.ProvidePrivate(NewClientsTable, NewAcksTable),
	// What the mTLS agent holds of this node's workloads: the bypass
	// check reads it.
	cell.Provide(statedb.RWTable[*Client].ToTable, statedb.RWTable[*Ack].ToTable),
	cell.Provide(newMetrics),
	// Registers the ADS service on the gRPC listener.
	cell.Provide(newServer),
)

// Type URLs of the Workload API.
const (
	AddressType       = "type.googleapis.com/istio.workload.Address"
	AuthorizationType = "type.googleapis.com/istio.security.Authorization"
)

// Config of the xDS streams.
type Config struct {
	// XDSCoalesce is the least time between two pushes on a stream: the
	// first change after a quiet period goes out at once, the changes that
	// follow within the window go out together.
	XDSCoalesce time.Duration
	// XDSSendTimeout closes a stream whose client has not taken a response
	// for this long (it reconnects with initial_resource_versions).
	XDSSendTimeout time.Duration
	// XDSMaxResourcesPerResponse splits large pushes (the initial
	// snapshot) into several responses.
	XDSMaxResourcesPerResponse int
	// XDSMaxNames bounds the resource names a stream may hold per type
	// (subscriptions and initial_resource_versions).
	XDSMaxNames int
	// XDSMaxStreams bounds the xDS streams open at once, so that the
	// names all streams hold are bounded too.
	XDSMaxStreams int
}

var defaultConfig = Config{
	XDSCoalesce:                10 * time.Millisecond,
	XDSSendTimeout:             30 * time.Second,
	XDSMaxResourcesPerResponse: 1000,
	XDSMaxNames:                250_000,
	XDSMaxStreams:              16,
}

// Flags implements cell.Flagger.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.Duration("xds-coalesce", def.XDSCoalesce, "Least time between two pushes on an xDS stream (the first change after a quiet period goes at once)")
	flags.Duration("xds-send-timeout", def.XDSSendTimeout, "Close an xDS stream whose client takes no response for this long")
	flags.Int("xds-max-resources-per-response", def.XDSMaxResourcesPerResponse, "Split pushes into responses of at most this many resources")
	flags.Int("xds-max-names", def.XDSMaxNames, "Resource names an xDS stream may hold per type (subscriptions, initial versions); more closes the stream")
	flags.Int("xds-max-streams", def.XDSMaxStreams, "xDS streams open at once (a node's mTLS agent holds one, two during its rolling update); more are refused")
}

func (c Config) validate() error {
	switch {
	case c.XDSCoalesce < 0:
		return fmt.Errorf("--xds-coalesce must not be negative")
	case c.XDSSendTimeout <= 0:
		return fmt.Errorf("--xds-send-timeout must be positive")
	case c.XDSMaxResourcesPerResponse < 1:
		return fmt.Errorf("--xds-max-resources-per-response must be at least 1")
	case c.XDSMaxNames < 1:
		return fmt.Errorf("--xds-max-names must be at least 1")
	case c.XDSMaxStreams < 1:
		return fmt.Errorf("--xds-max-streams must be at least 1")
	}
	return nil
}

// Metrics of the xDS server.
type Metrics struct {
	Streams       prometheus.Gauge
	ResourcesSent *prometheus.CounterVec
	Nacks         *prometheus.CounterVec
	// UnknownTypes counts requests for a type the server does not serve.
	UnknownTypes prometheus.Counter
	// Refused counts streams closed for breaking a bound, by reason.
	Refused *prometheus.CounterVec
	// ReconnectsUnchanged counts first requests that claimed exactly the
	// current workloads (answered by digest, nothing sent).
	ReconnectsUnchanged prometheus.Counter
}

func newMetrics(reg *prometheus.Registry) *Metrics {
	m := &Metrics{
		Streams: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "mtlsbridge_xds_streams", Help: "Open delta xDS streams",
		}),
		ResourcesSent: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mtlsbridge_xds_resources_sent_total", Help: "Resources (and removals) sent, by type",
		}, []string{"type"}),
		Nacks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mtlsbridge_xds_nacks_total", Help: "Responses rejected by clients, by type",
		}, []string{"type"}),
	}
	m.UnknownTypes = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "mtlsbridge_xds_unknown_type_requests_total", Help: "Requests for a resource type the server does not serve (ignored)",
	})
	m.Refused = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "mtlsbridge_xds_streams_refused_total", Help: "Streams closed for breaking a bound, by reason",
	}, []string{"reason"})
	m.ReconnectsUnchanged = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "mtlsbridge_xds_reconnects_unchanged_total", Help: "Wildcard streams whose initial versions were exactly the current workloads (nothing sent)",
	})
	reg.MustRegister(m.Streams, m.ResourcesSent, m.Nacks, m.UnknownTypes, m.Refused, m.ReconnectsUnchanged)
	return m
}
