// SPDX-License-Identifier: Apache-2.0

package identity

import (
	"context"
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
// for this node's mTLS agent, and for identities of enrolled pods on this
// node only.
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
	csr, id, rerr := CheckRequest(req.GetCsr(), req.GetMetadata(), s.trustDomain)
	if rerr == nil {
		rerr = s.checkLocalEnrolled(id)
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
	pod, _ := s.localHolder(id.String())

	issued, err := s.authority.SignWorkload(csr, id.String(), s.cfg.ttl(req.GetValidityDuration()))
	if err != nil {
		s.metrics.Refused.WithLabelValues("ca-unavailable").Inc()
		s.log.Error("Cannot sign", "identity", id.String(), "error", err)
		return nil, status.Error(codes.Unavailable, "ca-unavailable: "+err.Error())
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
	s.log.Info("Issued certificate", "identity", id.String(), "pod", pod, "notAfter", issued.Leaf.NotAfter)
	return &pb.IstioCertificateResponse{CertChain: issued.ChainPEM}, nil
}

// localHolder returns an enrolled pod on this node holding the identity.
func (s *caService) localHolder(id string) (string, bool) {
	for e := range s.enrollments.List(s.db.ReadTxn(), enrollment.OfThisNode()) {
		if e.Enrolled && (e.SpiffeID == id || e.IdentitySpiffeID == id) {
			return e.Key(), true
		}
	}
	return "", false
}

// checkLocalEnrolled refuses identities no enrolled pod on this node holds,
// telling "elsewhere" from "nowhere" where it can.
func (s *caService) checkLocalEnrolled(id spiffe.ID) *RequestError {
	if _, ok := s.localHolder(id.String()); ok {
		return nil
	}
	if id.Namespace != "" {
		txn := s.db.ReadTxn()
		for e := range s.enrollments.Prefix(txn, enrollment.ByKey(id.Namespace+"/")) {
			if e.Enrolled && e.SpiffeID == id.String() {
				return refuse(ReasonNotOnThisNode, "%s belongs to %s on node %q, not to a pod of this node", id, e.Key(), e.Node)
			}
		}
	}
	return refuse(ReasonNotEnrolled, "no enrolled pod on this node holds %s", id)
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
