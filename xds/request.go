// SPDX-License-Identifier: Apache-2.0

package xds

import (
	"context"
	"errors"
	"unicode/utf8"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/runtime/protoiface"

	"github.com/mtlsbridge/mtlsbridge/reconcilers/workload"
)

// request is a DeltaDiscoveryRequest as the stream reads it: the message
// without its initial_resource_versions, which come parsed apart.
type request struct {
	*discovery.DeltaDiscoveryRequest
	// initial are the initial_resource_versions.
	initial claims
}

// claims are what a client says it holds: names and versions (0 for a
// version that is not ours: always resent), and their digest. A
// reconnecting client claims every workload: the claims are kept as they
// come (sequential memory) and looked up by name only when the digest
// differs from the table's, through a map of name hashes (a map of 100k
// names costs ten times as much to fill and to probe).
type claims struct {
	names    []string
	hashes   []uint64
	versions []uint64
	digest   workload.Digest
	// byHash is the version claimed by name hash (built on first lookup;
	// the last claim of a name wins, as in the generated decoder's map). A
	// collision needs a name the client made up with the version of the
	// one it collides with: the client then misses that workload, which it
	// could refuse anyway.
	byHash map[uint64]uint64
}

func newClaims(n int) claims {
	return claims{names: make([]string, 0, n), hashes: make([]uint64, 0, n), versions: make([]uint64, 0, n)}
}

func (c *claims) add(name string, version uint64) {
	h := workload.NameHash(name)
	c.names = append(c.names, name)
	c.hashes = append(c.hashes, h)
	c.versions = append(c.versions, version)
	c.digest.Count++
	c.digest.Sum += workload.DigestTerm(h, version)
}

func (c *claims) index() {
	if c.byHash != nil || len(c.names) == 0 {
		return
	}
	c.byHash = make(map[uint64]uint64, len(c.hashes))
	for i, h := range c.hashes {
		c.byHash[h] = c.versions[i]
	}
}

// version is the version claimed for name.
func (c *claims) version(name string) (uint64, bool) {
	c.index()
	v, ok := c.byHash[workload.NameHash(name)]
	return v, ok
}

// held lists the claims by name.
func (c *claims) held() map[string]uint64 {
	held := make(map[string]uint64, len(c.names))
	for i, name := range c.names {
		held[name] = c.versions[i]
	}
	return held
}

// claimsOf makes claims of what a stream records as held.
func claimsOf(held map[string]uint64) claims {
	c := newClaims(len(held))
	for name, v := range held {
		c.add(name, v)
	}
	return c
}

// initialVersionsField is DeltaDiscoveryRequest.initial_resource_versions.
const initialVersionsField = 5

// errMalformedRequest: a request that is not a DeltaDiscoveryRequest.
var errMalformedRequest = errors.New("malformed DeltaDiscoveryRequest")

// decodeRequest reads a DeltaDiscoveryRequest. A client that reconnects
// sends the versions of everything it holds, 100k entries in a large
// cluster: decoded into the message's map by the generic decoder they cost
// about 30 times what this direct reading of the entries costs, so they
// are parsed here and the rest of the message is decoded as usual.
//
// More than maxNames entries are refused before any is decoded: a 16 MB
// request of empty entries would otherwise cost half a gigabyte of map.
func decodeRequest(b []byte, maxNames int) (request, error) {
	entries, err := countInitialVersions(b)
	if err != nil {
		return request{}, err
	}
	if entries > maxNames {
		return request{}, status.Errorf(codes.ResourceExhausted, "%d initial_resource_versions, more than --xds-max-names=%d", entries, maxNames)
	}
	var req request
	// The names are cut from one copy of the request rather than copied
	// one by one: they live only while the request is handled (what a
	// stream keeps holds the table's names).
	var text string
	if entries > 0 {
		req.initial = newClaims(entries)
		text = string(b)
	}
	var rest []byte
	for pos := 0; pos < len(b); {
		num, typ, n := protowire.ConsumeTag(b[pos:])
		fieldLen := protowire.ConsumeFieldValue(num, typ, b[pos+n:])
		field := b[pos : pos+n+fieldLen]
		if num != initialVersionsField || typ != protowire.BytesType {
			rest = append(rest, field...)
			pos += len(field)
			continue
		}
		_, m := protowire.ConsumeVarint(b[pos+n:])
		start := pos + n + m
		pos += len(field)
		key, value, err := mapEntry(b[start:pos])
		if err != nil {
			return request{}, err
		}
		entry := text[start:pos]
		name, version := entry[key[0]:key[1]], entry[value[0]:value[1]]
		// Strings of proto3 are UTF-8, as the generated decoder checks: a
		// name that is not could not be sent back (removed).
		if !utf8.ValidString(name) || !utf8.ValidString(version) {
			return request{}, errMalformedRequest
		}
		req.initial.add(name, parseVersion(version))
	}
	req.DeltaDiscoveryRequest = &discovery.DeltaDiscoveryRequest{}
	if err := proto.Unmarshal(rest, req.DeltaDiscoveryRequest); err != nil {
		return request{}, errMalformedRequest
	}
	return req, nil
}

// countInitialVersions checks the message's framing and counts its
// initial_resource_versions entries.
func countInitialVersions(b []byte) (int, error) {
	count := 0
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return 0, errMalformedRequest
		}
		fieldLen := protowire.ConsumeFieldValue(num, typ, b[n:])
		if fieldLen < 0 {
			return 0, errMalformedRequest
		}
		if num == initialVersionsField && typ == protowire.BytesType {
			count++
		}
		b = b[n+fieldLen:]
	}
	return count, nil
}

// parseVersion reads a version as the server writes them (hexadecimal);
// any other is 0, which never equals a workload's version.
func parseVersion(s string) uint64 {
	if len(s) == 0 || len(s) > 16 {
		return 0
	}
	var v uint64
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case '0' <= c && c <= '9':
			c -= '0'
		case 'a' <= c && c <= 'f':
			c -= 'a' - 10
		default:
			return 0
		}
		v = v<<4 | uint64(c)
	}
	return v
}

// mapEntry finds the key (field 1) and value (field 2) of a
// map<string, string> entry, as offsets into b: a missing field is empty,
// a repeated one counts last, as protobuf says.
func mapEntry(b []byte) (key, value [2]int, err error) {
	for pos := 0; pos < len(b); {
		num, typ, n := protowire.ConsumeTag(b[pos:])
		if n < 0 {
			return key, value, errMalformedRequest
		}
		pos += n
		if typ != protowire.BytesType {
			if n = protowire.ConsumeFieldValue(num, typ, b[pos:]); n < 0 {
				return key, value, errMalformedRequest
			}
			pos += n
			continue
		}
		v, n := protowire.ConsumeBytes(b[pos:])
		if n < 0 {
			return key, value, errMalformedRequest
		}
		span := [2]int{pos + n - len(v), pos + n}
		pos += n
		switch num {
		case 1:
			key = span
		case 2:
			value = span
		}
	}
	return key, value, nil
}

// rawRequest receives a request's bytes from gRPC: its protobuf
// reflection is DeltaDiscoveryRequest's, except that unmarshalling copies
// the bytes (for decodeRequest) instead of decoding them.
type rawRequest struct{ b []byte }

// requestType is read-only (a nil message): every stream shares it.
var requestType = (*discovery.DeltaDiscoveryRequest)(nil).ProtoReflect()

func (r *rawRequest) Reset()                             { r.b = r.b[:0] }
func (r *rawRequest) ProtoReflect() protoreflect.Message { return rawMessage{requestType, r} }

type rawMessage struct {
	protoreflect.Message
	r *rawRequest
}

func (m rawMessage) Interface() protoreflect.ProtoMessage { return m.r }

func (m rawMessage) ProtoMethods() *protoiface.Methods {
	return &protoiface.Methods{
		Flags: protoiface.SupportUnmarshalDiscardUnknown,
		Unmarshal: func(in protoiface.UnmarshalInput) (protoiface.UnmarshalOutput, error) {
			// gRPC reuses its buffer after this returns.
			m.r.b = append(m.r.b[:0], in.Buf...)
			return protoiface.UnmarshalOutput{Flags: protoiface.UnmarshalInitialized}, nil
		},
	}
}

// deltaStream is the part of a gRPC stream a delta stream uses.
type deltaStream interface {
	Context() context.Context
	SendMsg(m any) error
	RecvMsg(m any) error
}

// serviceDesc is the ADS service with DeltaAggregatedResources served
// from raw requests (rawRequest, decodeRequest).
func serviceDesc() *grpc.ServiceDesc {
	desc := discovery.AggregatedDiscoveryService_ServiceDesc
	desc.Streams = append([]grpc.StreamDesc(nil), desc.Streams...)
	for i := range desc.Streams {
		if desc.Streams[i].StreamName == "DeltaAggregatedResources" {
			desc.Streams[i].Handler = func(srv any, stream grpc.ServerStream) error {
				return srv.(*server).delta(stream)
			}
		}
	}
	return &desc
}

// recv reads the next request from the stream.
func recv(s deltaStream, maxNames int) (request, error) {
	var raw rawRequest
	if err := s.RecvMsg(&raw); err != nil {
		return request{}, err
	}
	return decodeRequest(raw.b, maxNames)
}
