// SPDX-License-Identifier: Apache-2.0

// Command mtlsbridge-proxy is the reference mTLS agent of CFP-32759 (package
// proxy): configured through ztunnel's environment variables, it takes the
// workloads from the node agent's delta xDS, certificates from its CA, and
// carries enrolled pods' TCP across nodes as HBONE.
//
// It runs in its own network namespace (the pod labelled
// cilium.io/redir-type=proxy) and needs CAP_NET_ADMIN (the capture, and
// transparent sockets, which CAP_NET_RAW also allows). With INPOD_UDS set it runs as ztunnel
// does in its in-pod mode: it takes pods' network namespaces from the node
// agent over ZDS and opens its listeners inside them (CAP_SYS_ADMIN too). SIGTERM or SIGINT stop it cleanly: the
// capture is removed, and until a new proxy starts, enrolled pods' new
// cross-node connections fail.
package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"runtime"
	"strings"
	"syscall"

	"github.com/mtlsbridge/mtlsbridge/proxy"
)

// envLogLevel sets the log level: debug, info (default), warn or error.
const envLogLevel = "MTLSBRIDGE_PROXY_LOG_LEVEL"

func main() {
	os.Exit(run())
}

func run() int {
	sysmonErr := keepSysmonAwake()
	// A node proxy shares its node with the pods it serves: as ztunnel
	// sizes its workers, it takes a quarter of the CPUs it may use (the Go
	// runtime already counts a cgroup CPU limit), at least one, unless
	// GOMAXPROCS says otherwise. On the 2-core testbed one thread per
	// proxy also gives the best throughput and latency (proxy/README.md).
	if os.Getenv("GOMAXPROCS") == "" {
		runtime.GOMAXPROCS(max(1, (runtime.GOMAXPROCS(0)+3)/4))
	}
	var level slog.Level
	if v := os.Getenv(envLogLevel); v != "" {
		if err := level.UnmarshalText([]byte(strings.ToUpper(v))); err != nil {
			fmt.Fprintf(os.Stderr, "mtlsbridge-proxy: %s=%q: %v\n", envLogLevel, v, err)
			return 2
		}
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	if sysmonErr != nil {
		log.Warn("Running without "+sysmonAwake+" in GODEBUG: more CPU and latency per request", "error", sysmonErr)
	}
	cfg, err := proxy.ConfigFromEnv(os.Getenv, os.Environ())
	if err != nil {
		log.Error("Configuration", "error", err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := proxy.New(cfg, log).Run(ctx); err != nil {
		log.Error("Proxy failed", "error", err)
		return 1
	}
	return 0
}
