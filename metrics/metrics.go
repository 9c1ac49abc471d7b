// SPDX-License-Identifier: Apache-2.0

// Package metrics provides the agent's Prometheus registry. Every component
// registers its metrics there; the local API serves them on /metrics.
package metrics

import (
	"github.com/cilium/hive/cell"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

// Cell provides the registry.
var Cell = cell.Module(
	"metrics",
	"Prometheus registry of the agent",

	// With the Go runtime's and the process's own metrics (memory, file
	// descriptors), which an operator checks first.
	cell.Provide(NewRegistry),
)

// NewRegistry returns a registry holding the runtime and process collectors.
func NewRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return reg
}
