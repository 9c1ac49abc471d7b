// SPDX-License-Identifier: Apache-2.0

package xds

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/mtlsbridge/mtlsbridge/grpcserver"
	"github.com/mtlsbridge/mtlsbridge/internal/logthrottle"
	"github.com/mtlsbridge/mtlsbridge/reconcilers"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/workload"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

type serverParams struct {
	cell.In

	Config    Config
	Log       *slog.Logger
	Metrics   *Metrics
	DB        *statedb.DB
	Workloads statedb.Table[*workload.Workload]
	// Digests answer a reconnect that claims exactly the table at once.
	Digests *workload.Digests `optional:"true"`
	// Pods and CNIPods (a new sandbox's addresses, before the API has
	// them) resolve on-demand "network/ip" names to workloads.
	Pods           statedb.Table[*tables.Pod]
	CNIPods        statedb.Table[*tables.CNIPod]
	WorkloadConfig workload.Config
	Clients        statedb.RWTable[*Client]
	Acks           statedb.RWTable[*Ack]
	// Node limits the acknowledgements kept to this node's workloads.
	Node tables.LocalNode `optional:"true"`
	// Auth checks a stream's caller again when its pod changes.
	Auth *grpcserver.Authenticator `optional:"true"`
}

// authenticator tells who calls: the caller the gRPC server's tap
// authenticated (grpcserver.CallerFrom).
type authenticator func(ctx context.Context) (grpcserver.Caller, error)

// server implements the ADS service: delta only.
type server struct {
	discovery.UnimplementedAggregatedDiscoveryServiceServer
	serverParams
	auth   authenticator
	nextID atomic.Uint64
	// open counts the streams held, against XDSMaxStreams.
	open atomic.Int32
	// buffers hold the buffers responses are written into, for the next
	// ones once gRPC has taken their bytes: an initial snapshot of 100k
	// workloads would otherwise allocate (and clear) its 24 MB anew.
	buffers *responseBuffers
}

func newServer(p serverParams) (grpcserver.ServiceOut, error) {
	if err := p.Config.validate(); err != nil {
		return grpcserver.ServiceOut{}, err
	}
	s := &server{serverParams: p, auth: grpcserver.CallerFrom, buffers: newResponseBuffers()}
	return grpcserver.ServiceOut{Service: func(srv *grpc.Server) {
		srv.RegisterService(serviceDesc(), s)
	}}, nil
}

// StreamAggregatedResources implements state-of-the-world ADS, which
// ztunnel never uses.
func (s *server) StreamAggregatedResources(discovery.AggregatedDiscoveryService_StreamAggregatedResourcesServer) error {
	return status.Error(codes.Unimplemented, "state-of-the-world ADS is not served: use DeltaAggregatedResources")
}

// newStream is the state of a new stream of caller.
func (s *server) newStream(ctx context.Context, grpcStream deltaStream, caller grpcserver.Caller) *stream {
	return &stream{
		srv: s, grpc: grpcStream, ctx: ctx, caller: caller,
		client: &Client{ID: s.nextID.Add(1), Pod: caller.Key(), ConnectedSince: time.Now(), Subscriptions: map[string]string{}},
		types:  map[string]*typeState{AddressType: {}, AuthorizationType: {}},
		logs:   logthrottle.New(10 * time.Second),
	}
}

// delta serves one authenticated delta stream (DeltaAggregatedResources,
// registered through serviceDesc).
func (s *server) delta(grpcStream deltaStream) error {
	ctx := grpcStream.Context()
	caller, err := s.auth(ctx)
	if err != nil {
		return err
	}
	if n := s.open.Add(1); int(n) > s.Config.XDSMaxStreams {
		s.open.Add(-1)
		s.Metrics.Refused.WithLabelValues("too-many-streams").Inc()
		s.Log.Warn("xDS stream refused: too many streams", "pod", caller.Key(), "max", s.Config.XDSMaxStreams)
		return status.Errorf(codes.ResourceExhausted, "%d xDS streams open, the most --xds-max-streams allows", s.Config.XDSMaxStreams)
	}
	defer s.open.Add(-1)
	// Nothing is answered from a table not yet derived from a full view
	// (the agent just started): told a partial table, a client drops the
	// workloads not derived yet, and ztunnel sends to a destination it
	// does not know without mTLS.
	if ok, _ := s.Workloads.Initialized(s.DB.ReadTxn()); !ok {
		s.Log.Info("xDS stream waits until the workloads table is derived", "pod", caller.Key())
	}
	if !reconcilers.WaitInitialized(ctx, nil, s.DB, s.Workloads) {
		return nil
	}
	st := s.newStream(ctx, grpcStream, caller)
	if p, ok := peer.FromContext(ctx); ok {
		st.client.Peer = p.Addr.String()
	}
	s.Metrics.Streams.Inc()
	defer s.Metrics.Streams.Dec()
	s.Log.Info("xDS stream opened", "stream", st.client.ID, "pod", st.client.Pod, "peer", st.client.Peer)

	err = st.run()
	st.forget()
	switch {
	case err == nil, errors.Is(err, io.EOF), status.Code(err) == codes.Canceled, ctx.Err() != nil:
		s.Log.Info("xDS stream closed", "stream", st.client.ID)
		return nil
	}
	s.Log.Warn("xDS stream failed", "stream", st.client.ID, "error", err)
	return err
}
