// SPDX-License-Identifier: Apache-2.0

package identity

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/cilium/statedb"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	pb "istio.io/api/security/v1alpha1"

	"github.com/mtlsbridge/mtlsbridge/grpcserver"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/enrollment"
	"github.com/mtlsbridge/mtlsbridge/spiffe"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// caService answers istio.v1.auth.IstioCertificateService/CreateCertificate
// for identities of enrolled pods of one node only: in the node agent, for
// this node's mTLS agent; in the signer, for a node agent, its node's.
type caService struct {
	pb.UnimplementedIstioCertificateServiceServer

	cfg          Config
	trustDomain  string
	localNode    tables.LocalNode
	log          *slog.Logger
	metrics      *Metrics
	authority    *Authority
	db           *statedb.DB
	enrollments  statedb.Table[*enrollment.Enrollment]
	certificates statedb.RWTable[*Certificate]
	// callers: in the signer, the node agents, each served for its own node.
	callers grpcserver.Callers
	// upstream, when set, signs instead of the authority (--ca-upstream).
	upstream *upstream
	pods     statedb.Table[*tables.Pod]
	// kubernetes: pods come from the API server, which gives every pod
	// but a static one a service account.
	kubernetes bool
}

func (s *caService) register(srv *grpc.Server) { pb.RegisterIstioCertificateServiceServer(srv, s) }

// CreateCertificate implements pb.IstioCertificateServiceServer.
func (s *caService) CreateCertificate(ctx context.Context, req *pb.IstioCertificateRequest) (*pb.IstioCertificateResponse, error) {
	caller, err := grpcserver.CallerFrom(ctx)
	if err != nil {
		s.metrics.Refused.WithLabelValues("unauthenticated").Inc()
		return nil, err
	}
	if len(req.GetCsr()) > maxCSRBytes {
		s.metrics.Refused.WithLabelValues(ReasonMalformedCSR).Inc()
		return nil, status.Errorf(codes.InvalidArgument, "%s: csr of %d bytes, a CSR needs at most %d", ReasonMalformedCSR, len(req.GetCsr()), maxCSRBytes)
	}
	node, signer := s.localNode.NodeName, len(s.callers.NodeAgents) > 0
	if signer {
		node = caller.Node
	}
	csr, id, rerr := CheckRequest(req.GetCsr(), req.GetMetadata(), s.trustDomain)
	var pod string
	switch {
	case rerr != nil:
	case signer && id.CiliumIdentity != 0:
		// A pod's Cilium identity comes from its CiliumEndpoint, which
		// every node's Cilium may write: the node would choose it.
		rerr = refuse(ReasonIdentityScheme, "the signer signs spiffe://TD/ns/NS/sa/SA identities only, not %s: "+
			"a pod's Cilium identity is what its node's Cilium writes in its CiliumEndpoint", id)
	default:
		pod, rerr = s.checkEnrolledOn(node, id)
	}
	if rerr != nil {
		s.metrics.Refused.WithLabelValues(rerr.Reason).Inc()
		s.log.Warn("Refused certificate request", "caller", caller.Key(), "reason", rerr.Reason, "error", rerr.Message)
		code := codes.PermissionDenied
		if rerr.Reason == ReasonMalformedCSR {
			code = codes.InvalidArgument
		}
		return nil, status.Error(code, rerr.Error())
	}

	ttl := s.cfg.ttl(req.GetValidityDuration())
	var issued *Issued
	if s.upstream != nil {
		issued, err = s.upstream.sign(ctx, req.GetCsr(), csr, id.String(), ttl)
	} else {
		issued, err = s.authority.SignWorkload(csr, id.String(), ttl)
	}
	if err != nil {
		reason := "ca-unavailable"
		var upErr *upstreamError
		if errors.As(err, &upErr) {
			reason = upErr.reason
		}
		s.metrics.Refused.WithLabelValues(reason).Inc()
		s.log.Error("Cannot sign", "identity", id.String(), "reason", reason, "upstream", s.cfg.CAUpstream, "error", err)
		return nil, status.Error(codes.Unavailable, reason+": "+err.Error())
	}
	txn := s.db.WriteTxn(s.certificates)
	recordIssued(txn, s.certificates, &Certificate{
		Serial:   fmt.Sprintf("%x", issued.Leaf.SerialNumber),
		SpiffeID: id.String(),
		Pod:      pod,
		IssuedAt: time.Now(),
		NotAfter: issued.Leaf.NotAfter,
	})
	txn.Commit()
	s.metrics.Issued.Inc()
	s.log.Info("Issued certificate", "identity", id.String(), "pod", pod, "node", node, "notAfter", issued.Leaf.NotAfter)
	return &pb.IstioCertificateResponse{CertChain: issued.ChainPEM}, nil
}

// checkEnrolledOn returns the enrolled pod on node that holds the identity,
// or refuses, telling "elsewhere" from "nowhere" where it can. In
// Kubernetes mode a pod without a service account holds none: it is a
// static pod, whose service account the API server never checked (it
// refuses one), so a node could give it any namespace's default account.
func (s *caService) checkEnrolledOn(node string, id spiffe.ID) (string, *RequestError) {
	if node == "" {
		return "", refuse(ReasonNotOnThisNode, "the caller's node is not known")
	}
	txn := s.db.ReadTxn()
	// The node agent indexes its own node's rows; the signer's are the
	// cluster's enrolled pods, found by the identity's namespace.
	rows := s.enrollments.List(txn, enrollment.OfThisNode())
	if node != s.localNode.NodeName {
		rows = s.enrollments.All(txn)
		if id.Namespace != "" {
			rows = s.enrollments.Prefix(txn, enrollment.ByKey(id.Namespace+"/"))
		}
	}
	static := ""
	for e := range rows {
		if e.Node != node || !e.Holds(id.String()) {
			continue
		}
		if pod, _, found := s.pods.Get(txn, tables.PodByKey(e.Key())); s.kubernetes && found && pod.ServiceAccount == "" {
			static = e.Key()
			continue
		}
		return e.Key(), nil
	}
	if static != "" {
		return "", refuse(ReasonNoServiceAccount, "%s is held on node %q only by %s, a pod without a service account (a static pod)", id, node, static)
	}
	if id.Namespace != "" {
		for e := range s.enrollments.Prefix(txn, enrollment.ByKey(id.Namespace+"/")) {
			if e.Holds(id.String()) {
				return "", refuse(ReasonNotOnThisNode, "%s belongs to %s on node %q, not to a pod of node %q", id, e.Key(), e.Node, node)
			}
		}
	}
	return "", refuse(ReasonNotEnrolled, "no enrolled pod on node %q holds %s", node, id)
}

// maxCSRBytes is more than any CSR ztunnel sends (an ECDSA P-256 CSR with
// one URI SAN is under 1 KiB; RSA 4096 about 2 KiB).
const maxCSRBytes = 64 << 10

// ttl bounds a requested validity (seconds; 0 or less means the default).
func (c Config) ttl(requested int64) time.Duration {
	if requested <= 0 {
		return c.CADefaultCertTTL
	}
	d := time.Duration(requested) * time.Second
	return min(max(d, minCertTTL), c.CAMaxCertTTL)
}

// minCertTTL keeps a client from asking for certificates that expire before
// they are used.
const minCertTTL = 10 * time.Minute
