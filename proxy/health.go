// SPDX-License-Identifier: Apache-2.0

package proxy

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// ReadyPath is ztunnel's readiness endpoint on port 15021.
const ReadyPath = "/healthz/ready"

// serveHealth serves readiness (15021) and metrics (15020) until the
// returned function is called.
func (p *Proxy) serveHealth(ctx context.Context) (func(), error) {
	ready := http.NewServeMux()
	ready.HandleFunc(ReadyPath, p.readyHandler)
	metrics := http.NewServeMux()
	metrics.Handle("/metrics", promhttp.HandlerFor(p.registry, promhttp.HandlerOpts{}))

	var servers []*http.Server
	for _, s := range []struct {
		addr    string
		handler http.Handler
	}{{p.cfg.ReadinessListen, ready}, {p.cfg.MetricsListen, metrics}} {
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
