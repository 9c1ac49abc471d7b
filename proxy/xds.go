// SPDX-License-Identifier: Apache-2.0

package proxy

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"strings"
	"sync"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	statuspb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
	"istio.io/istio/pkg/workloadapi"
	"istio.io/istio/pkg/workloadapi/security"
)

// Type URLs of ztunnel's delta xDS.
const (
	AddressType       = "type.googleapis.com/istio.workload.Address"
	AuthorizationType = "type.googleapis.com/istio.security.Authorization"
)

// Reconnection backoff, as ztunnel's xDS client: doubling from the first
// to the last, reset after a stream that received a response.
const (
	xdsBackoffFirst = 100 * time.Millisecond
	xdsBackoffMax   = 15 * time.Second
)

// XDS is a delta ADS client that keeps State equal to what the server
// says. It subscribes to both types as wildcard, ACKs what it applies,
// NACKs (per resource) what it cannot use, and reconnects with backoff,
// sending the versions it holds in initial_resource_versions so that the
// server sends only what changed and removes what went meanwhile.
type XDS struct {
	cfg     Config
	state   *State
	metrics *Metrics
	log     *slog.Logger

	// versions[type][name] is the version of each resource held; only
	// the Run goroutine touches it.
	versions map[string]map[string]string

	syncOnce sync.Once
	synced   chan struct{}
}

// NewXDS returns a client that writes into state.
func NewXDS(cfg Config, state *State, metrics *Metrics, log *slog.Logger) *XDS {
	return &XDS{
		cfg: cfg, state: state, metrics: metrics, log: log,
		versions: map[string]map[string]string{AddressType: {}, AuthorizationType: {}},
		synced:   make(chan struct{}),
	}
}

// Synced is closed once the first response of each type was applied and
// answered; it stays closed across reconnections (the state is kept).
func (x *XDS) Synced() <-chan struct{} { return x.synced }

// Run keeps a stream open until ctx ends.
func (x *XDS) Run(ctx context.Context) {
	backoff := xdsBackoffFirst
	for ctx.Err() == nil {
		gotResponse, err := x.session(ctx)
		if ctx.Err() != nil {
			return
		}
		if gotResponse {
			backoff = xdsBackoffFirst
		}
		wait := backoff/2 + rand.N(backoff/2+1)
		x.log.Warn("xDS stream ended, reconnecting", "address", x.cfg.XDSAddress, "error", err, "in", wait)
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
		backoff = min(backoff*2, xdsBackoffMax)
	}
}

// session runs one stream; it reports whether any response arrived.
func (x *XDS) session(ctx context.Context) (bool, error) {
	conn, err := dialGRPC(x.cfg.XDSAddress, x.cfg.XDSRoot, tokenCredentials{path: x.cfg.TokenPath, clusterID: x.cfg.ClusterID})
	if err != nil {
		return false, err
	}
	defer conn.Close()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := discovery.NewAggregatedDiscoveryServiceClient(conn).DeltaAggregatedResources(ctx)
	if err != nil {
		return false, err
	}
	x.metrics.XDSConnects.Inc()
	node := x.node()
	for _, typeURL := range []string{AddressType, AuthorizationType} {
		req := &discovery.DeltaDiscoveryRequest{
			Node:                    node,
			TypeUrl:                 typeURL,
			InitialResourceVersions: maps.Clone(x.versions[typeURL]),
		}
		if err := stream.Send(req); err != nil {
			return false, fmt.Errorf("subscribe %s: %w", typeURL, err)
		}
	}
	answered := map[string]bool{}
	got := false
	for {
		resp, err := stream.Recv()
		if err != nil {
			return got, err
		}
		got = true
		x.metrics.XDSResponses.WithLabelValues(shortType(resp.GetTypeUrl())).Inc()
		reply := &discovery.DeltaDiscoveryRequest{TypeUrl: resp.GetTypeUrl(), ResponseNonce: resp.GetNonce()}
		if rejected := x.apply(resp); rejected != nil {
			x.metrics.XDSNACKs.WithLabelValues(shortType(resp.GetTypeUrl())).Inc()
			x.log.Warn("NACK: resources rejected", "type", resp.GetTypeUrl(), "nonce", resp.GetNonce(), "error", rejected)
			// Code left 0 as ztunnel does; the detail is what counts.
			reply.ErrorDetail = &statuspb.Status{Message: rejected.Error()}
		}
		if err := stream.Send(reply); err != nil {
			return got, fmt.Errorf("answer %s: %w", resp.GetTypeUrl(), err)
		}
		answered[resp.GetTypeUrl()] = true
		if answered[AddressType] && answered[AuthorizationType] {
			x.syncOnce.Do(func() {
				x.log.Info("xDS synced", "workloads", len(x.versions[AddressType]), "authorizations", len(x.versions[AuthorizationType]))
				close(x.synced)
			})
		}
	}
}

// apply writes a response into the state. Each resource is applied or
// rejected on its own; the error joins the rejections (nil: ACK).
func (x *XDS) apply(resp *discovery.DeltaDiscoveryResponse) error {
	typeURL := resp.GetTypeUrl()
	held, ok := x.versions[typeURL]
	if !ok {
		return fmt.Errorf("%w: type %s not subscribed", ErrBadResource, typeURL)
	}
	var rejected []error
	for _, r := range resp.GetResources() {
		if err := x.applyResource(typeURL, r); err != nil {
			rejected = append(rejected, fmt.Errorf("%s: %w", r.GetName(), err))
			continue
		}
		held[r.GetName()] = r.GetVersion()
	}
	for _, name := range resp.GetRemovedResources() {
		delete(held, name)
		switch typeURL {
		case AddressType:
			x.state.deleteWorkload(name)
		case AuthorizationType:
			x.state.deletePolicy(name)
		}
	}
	x.metrics.Workloads.Set(float64(len(x.state.Workloads())))
	x.metrics.Policies.Set(float64(len(x.versions[AuthorizationType])))
	return errors.Join(rejected...)
}

func (x *XDS) applyResource(typeURL string, r *discovery.Resource) error {
	anyRes := r.GetResource()
	if anyRes == nil || anyRes.GetTypeUrl() != typeURL {
		return fmt.Errorf("%w: inner type %q, want %q", ErrBadResource, anyRes.GetTypeUrl(), typeURL)
	}
	switch typeURL {
	case AddressType:
		var addr workloadapi.Address
		if err := proto.Unmarshal(anyRes.GetValue(), &addr); err != nil {
			return fmt.Errorf("%w: %v", ErrBadResource, err)
		}
		w := addr.GetWorkload()
		if w == nil {
			// A Service: nothing the proxy uses yet (no load balancing
			// through Services); it is held so that its version is sent
			// back on reconnection.
			return nil
		}
		wl, err := workloadFrom(w)
		if err != nil {
			return err
		}
		x.state.putWorkload(r.GetName(), wl)
	case AuthorizationType:
		var p security.Authorization
		if err := proto.Unmarshal(anyRes.GetValue(), &p); err != nil {
			return fmt.Errorf("%w: %v", ErrBadResource, err)
		}
		if err := checkPolicy(&p); err != nil {
			return err
		}
		x.state.putPolicy(r.GetName(), &p)
	}
	return nil
}

// node is the xDS node ztunnel sends.
func (x *XDS) node() *core.Node {
	ip := x.cfg.InstanceIP
	if ip == "" {
		ip = "1.1.1.1" // ztunnel's placeholder when INSTANCE_IP is unset
	}
	fields := map[string]*structpb.Value{}
	for k, v := range x.cfg.Metadata {
		fields[k] = structpb.NewStringValue(v)
	}
	for k, v := range map[string]string{
		"NAME": x.cfg.PodName, "NAMESPACE": x.cfg.PodNamespace, "INSTANCE_IPS": ip,
		"NODE_NAME": x.cfg.NodeName, "CLUSTER_ID": x.cfg.ClusterID,
	} {
		fields[k] = structpb.NewStringValue(v)
	}
	return &core.Node{
		Id:       fmt.Sprintf("ztunnel~%s~%s.%s~%s.svc.cluster.local", ip, x.cfg.PodName, x.cfg.PodNamespace, x.cfg.PodNamespace),
		Metadata: &structpb.Struct{Fields: fields},
	}
}

// shortType is the last element of a type URL, for metric labels.
func shortType(typeURL string) string {
	if i := strings.LastIndexByte(typeURL, '.'); i >= 0 {
		return typeURL[i+1:]
	}
	return typeURL
}
