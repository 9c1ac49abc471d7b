// SPDX-License-Identifier: Apache-2.0

package proxy

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/pprof"
	"slices"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Endpoints as ztunnel's: readiness on 15021, config dump on the admin
// port 15000 (loopback).
const (
	ReadyPath      = "/healthz/ready"
	ConfigDumpPath = "/config_dump"
)

// serveHealth serves readiness (15021), metrics (15020) and the config dump
// (127.0.0.1:15000) until the returned function is called.
func (p *Proxy) serveHealth(ctx context.Context) (func(), error) {
	ready := http.NewServeMux()
	ready.HandleFunc(ReadyPath, p.readyHandler)
	metrics := http.NewServeMux()
	metrics.Handle("/metrics", promhttp.HandlerFor(p.registry, promhttp.HandlerOpts{}))
	admin := http.NewServeMux()
	admin.HandleFunc(ConfigDumpPath, p.configDump)
	// Profiles, as ztunnel's admin port serves them (loopback only).
	admin.HandleFunc("/debug/pprof/", pprof.Index)
	admin.HandleFunc("/debug/pprof/profile", pprof.Profile)

	var servers []*http.Server
	for _, s := range []struct {
		addr    string
		handler http.Handler
	}{{p.cfg.ReadinessListen, ready}, {p.cfg.MetricsListen, metrics}, {p.cfg.AdminListen, admin}} {
		var lc net.ListenConfig
		l, err := lc.Listen(ctx, "tcp", s.addr)
		if err != nil {
			for _, srv := range servers {
				srv.Close()
			}
			return nil, fmt.Errorf("listen %s: %w", s.addr, err)
		}
		srv := &http.Server{Handler: s.handler, ReadHeaderTimeout: 5 * time.Second, MaxHeaderBytes: maxHeaderBytes}
		servers = append(servers, srv)
		go func() {
			if err := srv.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
				p.log.Error("Health server", "address", s.addr, "error", err)
			}
		}()
	}
	return func() {
		for _, srv := range servers {
			srv.Close()
		}
	}, nil
}

// ReadyHandler serves ReadyPath (as on port 15021).
func (p *Proxy) ReadyHandler() http.Handler { return http.HandlerFunc(p.readyHandler) }

// readyHandler answers 200 once ready, else 503 with what is missing.
func (p *Proxy) readyHandler(w http.ResponseWriter, _ *http.Request) {
	if p.ready.Load() {
		fmt.Fprintln(w, "ready")
		return
	}
	var missing []string
	select {
	case <-p.xds.Synced():
	default:
		missing = append(missing, "xDS not synced")
	}
	if p.inpod != nil {
		select {
		case <-p.inpod.snapshot:
		default:
			missing = append(missing, "no ZDS snapshot from the node agent")
		}
	}
	held := map[string]bool{}
	for _, id := range p.certs.Identities() {
		held[id] = true
	}
	for id := range p.state.LocalIdentities() {
		if !held[id] {
			missing = append(missing, "no certificate for "+id)
		}
	}
	http.Error(w, "not ready: "+strings.Join(missing, "; "), http.StatusServiceUnavailable)
}

// ConfigDump is what /config_dump answers: what xDS told the proxy and the
// certificates it holds.
type ConfigDump struct {
	Ready          bool                 `json:"ready"`
	Workloads      []*Workload          `json:"workloads"`
	Authorizations []string             `json:"authorizations"`
	Certificates   []CertificateSummary `json:"certificates"`
	// Pods are the pods served in their namespace (in-pod mode).
	Pods []InPodSummary `json:"pods,omitempty"`
}

// InPodSummary is a pod the node agent handed over ZDS.
type InPodSummary struct {
	UID            string `json:"uid"`
	Namespace      string `json:"namespace"`
	Name           string `json:"name"`
	ServiceAccount string `json:"serviceAccount"`
}

// CertificateSummary describes a held certificate (never its key).
type CertificateSummary struct {
	Identity string    `json:"identity"`
	Serial   string    `json:"serial"`
	NotAfter time.Time `json:"notAfter"`
}

func (p *Proxy) configDump(w http.ResponseWriter, _ *http.Request) {
	d := ConfigDump{Ready: p.ready.Load(), Workloads: p.state.Workloads(), Authorizations: p.state.PolicyNames()}
	slices.SortFunc(d.Workloads, func(a, b *Workload) int { return strings.Compare(a.UID, b.UID) })
	for _, id := range p.certs.Identities() {
		if c := p.certs.Get(id); c != nil {
			d.Certificates = append(d.Certificates, CertificateSummary{Identity: id, Serial: c.Leaf.SerialNumber.Text(16), NotAfter: c.Leaf.NotAfter})
		}
	}
	if p.inpod != nil {
		d.Pods = p.inpod.summary()
	}
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.Encode(d)
}
