// SPDX-License-Identifier: Apache-2.0

package xds

import (
	"context"
	"encoding/binary"
	"errors"
	"math"
	"strings"
	"unicode/utf8"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

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
// reconnecting client claims every workload, and usually exactly the
// table: decoding only sums the digest (workload.Digest), and the claims
// themselves are read from the request, kept as it came, when they are
// needed: when the digest differs from the table's. They are then kept as
// they come (sequential memory) and looked up through a map of name
// hashes (a map of 100k names costs ten times as much to fill and to
// probe).
type claims struct {
	digest workload.Digest
	// raw is the request the claims are read from, until read (see
	// keep).
	raw mem.BufferSlice
	// longest is the size of the largest entry.
	longest int

	names    []string
	hashes   []uint64
	versions []uint64
	// byHash is the version claimed by name hash (built on first lookup;
	// the last claim of a name wins, as in the generated decoder's map). A
	// collision needs a name the client made up with the version of the
	// one it collides with: the client then misses that workload, which it
	// could refuse anyway.
	byHash map[uint64]uint64
}

// count is how many claims there are.
func (c *claims) count() int { return c.digest.Count }

// read reads the claims from the request; every other method needs it
// done. An entry that is not a map entry of two strings, UTF-8 in proto3
// (as the generated decoder checks: a name that is not could not even be
// sent back removed), ends the stream.
func (c *claims) read() error {
	if c.raw == nil {
		return nil
	}
	// The names are cut from one copy of the request rather than copied
	// one by one: they live only while the request is handled (what a
	// stream keeps holds the table's names).
	var copied strings.Builder
	copied.Grow(c.raw.Len())
	for _, buf := range c.raw {
		copied.Write(buf.ReadOnlyData())
	}
	text := copied.String()
	c.names = make([]string, 0, c.digest.Count)
	c.hashes = make([]uint64, 0, c.digest.Count)
	c.versions = make([]uint64, 0, c.digest.Count)
	err := fields(c.raw, func(f field) error {
		if !f.isClaim() {
			return nil
		}
		key, value, err := mapEntry(f.value())
		if err != nil {
			return status.Errorf(codes.InvalidArgument, "%v: an initial_resource_versions entry is malformed", errMalformedRequest)
		}
		at := f.at + f.header
		n, v := text[at+key[0]:at+key[1]], text[at+value[0]:at+value[1]]
		if !utf8.ValidString(n) || !utf8.ValidString(v) {
			return status.Errorf(codes.InvalidArgument, "%v: an initial_resource_versions entry is not UTF-8", errMalformedRequest)
		}
		c.names = append(c.names, n)
		c.hashes = append(c.hashes, workload.NameHash(n))
		c.versions = append(c.versions, parseVersion(v))
		return nil
	})
	c.raw = nil
	return err
}

// add claims name at version (claims of what was sent: they have no
// digest).
func (c *claims) add(name string, version uint64) {
	c.names = append(c.names, name)
	c.hashes = append(c.hashes, workload.NameHash(name))
	c.versions = append(c.versions, version)
	c.digest.Count++
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
	if c.count() == 0 {
		return 0, false // a new client: nothing to hash
	}
	c.index()
	v, ok := c.byHash[workload.NameHash(name)]
	return v, ok
}

// claimsOf makes claims of what a stream records as held.
func claimsOf(held map[string]uint64) claims {
	var c claims
	for name, v := range held {
		c.add(name, v)
	}
	return c
}

// initialVersionsField is DeltaDiscoveryRequest.initial_resource_versions.
const initialVersionsField = 5

// errMalformedRequest: a request that is not a DeltaDiscoveryRequest.
var errMalformedRequest = errors.New("malformed DeltaDiscoveryRequest")

// decodeRequest reads a DeltaDiscoveryRequest from gRPC's receive
// buffers (about 16 KB each). A client that reconnects sends the versions
// of everything it holds, 100k entries and 6 MB in a large cluster:
// decoded into the message's map by the generic decoder they cost about 30
// times what this direct reading of the entries costs, so they are only
// framed and summed into a digest here, where gRPC received them (nothing
// is copied or kept per entry; claims.read reads and checks them if
// needed), and the rest of the message is decoded as usual. The claims
// keep the request (keep) by a reference of their own, never freed: gRPC
// reuses a buffer once its last reference is freed, and claims are read
// later, on another goroutine; unfreed, the buffers are only collected.
//
// More than maxNames entries are refused before any is kept: a 16 MB
// request of empty entries would otherwise cost half a gigabyte of map.
// So is an entry longer than a name and a version can be.
func decodeRequest(data mem.BufferSlice, maxNames int) (request, error) {
	req, err := decodeFields(data, maxNames)
	if errors.Is(err, errSplitField) {
		// A field of a kind its header does not size (a group) across
		// buffers: read from the message made whole.
		req, err = decodeFields(oneBuffer(data.Materialize()), maxNames)
	}
	return req, err
}

func decodeFields(data mem.BufferSlice, maxNames int) (request, error) {
	var req request
	var rest []byte
	err := fields(data, func(f field) error {
		if !f.isClaim() {
			rest = append(rest, f.raw...)
			return nil
		}
		req.initial.digest.Count++
		req.initial.digest.Sum += workload.EntryTerm(f.value())
		req.initial.longest = max(req.initial.longest, len(f.value()))
		return nil
	})
	if err != nil {
		return request{}, err
	}
	if n := req.initial.digest.Count; n > maxNames {
		return request{}, status.Errorf(codes.ResourceExhausted, "%d initial_resource_versions, more than --xds-max-names=%d", n, maxNames)
	}
	if req.initial.longest > maxClaimBytes {
		return request{}, status.Errorf(codes.ResourceExhausted, "an initial_resource_versions entry of %d bytes, more than %d", req.initial.longest, maxClaimBytes)
	}
	if req.initial.digest.Count > 0 {
		req.initial.raw = keep(data)
	}
	req.DeltaDiscoveryRequest = &discovery.DeltaDiscoveryRequest{}
	if err := proto.Unmarshal(rest, req.DeltaDiscoveryRequest); err != nil {
		return request{}, errMalformedRequest
	}
	return req, nil
}

// A stream keeps the names a client subscribes to or claims; they are
// bounded in number (--xds-max-names) and in length. Names are workload
// uids (CLUSTER//Pod/NAMESPACE/NAME) and addresses (NETWORK/IP), a few
// hundred bytes at most.
const (
	maxNameBytes = 1 << 10
	// maxClaimBytes bounds an initial_resource_versions entry: a name, a
	// version (16 hex digits from us; any string from a client) and their
	// framing.
	maxClaimBytes = 2 * maxNameBytes
)

// keep keeps a message for later: gRPC's buffers, by a reference of their
// own, when they hold little more than the message; a copy otherwise. The
// client chooses its frames, and so the buffers: one of just over 1 KB
// takes a buffer of 4 KB, one of a byte about 40 bytes of overhead.
func keep(data mem.BufferSlice) mem.BufferSlice {
	held := 0
	for _, buf := range data {
		held += cap(buf.ReadOnlyData()) + bufferOverhead
	}
	if held > data.Len()+data.Len()/4 {
		return oneBuffer(data.Materialize())
	}
	data.Ref()
	return data
}

// bufferOverhead is about what gRPC's buffer costs beside its bytes.
const bufferOverhead = 48

// field is one field of a message, whole.
type field struct {
	num protowire.Number
	typ protowire.Type
	// raw is the field: tag, then value (a bytes field's with its length).
	raw []byte
	// header is where the value starts in raw, after a bytes field's
	// length.
	header int
	// at is where raw starts in the message.
	at int
}

// value is the field's value (a bytes field's without its length).
func (f *field) value() []byte { return f.raw[f.header:] }

// isClaim tells an entry of DeltaDiscoveryRequest.initial_resource_versions.
func (f *field) isClaim() bool { return f.num == initialVersionsField && f.typ == protowire.BytesType }

// errSplitField: a field across buffers that fields does not join (see
// fields).
var errSplitField = errors.New("a field across buffers that its header does not size")

// maxFieldHeader is the most bytes that size any field but a group: a tag
// and a varint (a value, or a bytes field's length).
const maxFieldHeader = 2 * binary.MaxVarintLen64

// fields calls each with every field of the message held in data, checking
// its framing. A field that lies in one buffer is passed in place; one
// across buffers is first joined into a slice of its own, reused for the
// next: a field is valid only during the call. So the message passes
// through memory once, as it would when made whole first, but without a
// copy of it. A group across buffers, which only its end sizes, is not
// joined: errSplitField.
func fields(data mem.BufferSlice, each func(field) error) error {
	var header [maxFieldHeader]byte
	var joined []byte
	// b is what is left of the buffer being read, data[next] the one
	// after.
	var b []byte
	next, at := 0, 0
	for {
		for len(b) == 0 {
			if next == len(data) {
				return nil
			}
			b, next = data[next].ReadOnlyData(), next+1
		}
		f := field{at: at}
		var size int
		var ok bool
		if f.num, f.typ, f.header, size, ok = fieldSize(b); ok && size <= len(b) {
			f.raw, b = b[:size], b[size:]
		} else {
			if next == len(data) {
				return errMalformedRequest // cut short, or not a field
			}
			// The header ahead sizes the field (larger than b: b alone
			// did not).
			if f.num, f.typ, f.header, size, ok = fieldSize(ahead(header[:0], b, data[next:])); !ok {
				return errSplitField
			}
			joined = append(joined[:0], b...)
			for b = nil; len(joined) < size; next++ {
				if next == len(data) {
					return errMalformedRequest
				}
				more := data[next].ReadOnlyData()
				k := min(size-len(joined), len(more))
				joined, b = append(joined, more[:k]...), more[k:]
			}
			f.raw = joined
		}
		at += size
		if err := each(f); err != nil {
			return err
		}
	}
}

// ahead fills dst, up to its capacity, with b and the buffers after it.
func ahead(dst, b []byte, after mem.BufferSlice) []byte {
	dst = append(dst, b[:min(len(b), cap(dst))]...)
	for _, buf := range after {
		if len(dst) == cap(dst) {
			break
		}
		more := buf.ReadOnlyData()
		dst = append(dst, more[:min(len(more), cap(dst)-len(dst))]...)
	}
	return dst
}

// fieldSize reads the field at the start of b: its number, type, where
// its value starts and its size; false when b holds too little of it to
// tell (all of a group), or it is not a field.
func fieldSize(b []byte) (num protowire.Number, typ protowire.Type, header, size int, ok bool) {
	num, typ, n := protowire.ConsumeTag(b)
	if n < 0 {
		return 0, 0, 0, 0, false
	}
	if typ == protowire.BytesType {
		length, m := protowire.ConsumeVarint(b[n:])
		if m < 0 || length > math.MaxInt32-maxFieldHeader { // int may be 32 bits
			return 0, 0, 0, 0, false
		}
		return num, typ, n + m, n + m + int(length), true
	}
	m := protowire.ConsumeFieldValue(num, typ, b[n:])
	if m < 0 {
		return 0, 0, 0, 0, false
	}
	return num, typ, n, n + m, true
}

// oneBuffer is a message held in one slice, as gRPC's buffers.
func oneBuffer(b []byte) mem.BufferSlice { return mem.BufferSlice{mem.SliceBuffer(b)} }

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

// rawRequest decodes a request where gRPC received it
// (grpcserver.Retained).
type rawRequest struct {
	maxNames int
	req      request
	err      error
}

func (r *rawRequest) Retain(data mem.BufferSlice) { r.req, r.err = decodeRequest(data, r.maxNames) }

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
	raw := rawRequest{maxNames: maxNames}
	if err := s.RecvMsg(&raw); err != nil {
		return request{}, err
	}
	return raw.req, raw.err
}
