// SPDX-License-Identifier: Apache-2.0

package cni

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/mtlsbridge/mtlsbridge/cni/plugin"
)

// metrics of the CNI route: how long pod starts are held, and how they end.
type metrics struct {
	answers *prometheus.HistogramVec
}

// Answer labels: the redirect states of plugin.Answer, and "unknown" for a
// pod the agent has not seen in the API.
const answerUnknown = "unknown"

func newMetrics(reg *prometheus.Registry) *metrics {
	m := &metrics{answers: prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "mtlsbridge_cni_answer_seconds",
		Help: "Time the agent held the CNI plugin's question at pod start, by answer " +
			"(ready, not-needed: the pod starts; pending, unknown: ADD fails and the kubelet retries)",
		Buckets: prometheus.ExponentialBuckets(0.001, 2, 16), // 1 ms to 33 s
	}, []string{"answer"})}
	reg.MustRegister(m.answers)
	return m
}

func answerLabel(a plugin.Answer) string {
	if !a.Known {
		return answerUnknown
	}
	return a.Redirect
}
