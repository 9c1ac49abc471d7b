// SPDX-License-Identifier: Apache-2.0

package xds

import (
	"math/bits"
	"slices"
	"strconv"

	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"

	"github.com/mtlsbridge/mtlsbridge/reconcilers/workload"
)

// Field numbers of the messages the server writes by hand (envoy's
// discovery.proto and google.protobuf.Any).
const (
	responseResourcesField = 2 // DeltaDiscoveryResponse.resources
	responseTypeURLField   = 4 // DeltaDiscoveryResponse.type_url
	responseNonceField     = 5 // DeltaDiscoveryResponse.nonce
	responseRemovedField   = 6 // DeltaDiscoveryResponse.removed_resources

	resourceVersionField  = 1 // Resource.version
	resourceResourceField = 2 // Resource.resource
	resourceNameField     = 3 // Resource.name
	resourceAliasesField  = 4 // Resource.aliases

	anyTypeURLField = 1 // Any.type_url
	anyValueField   = 2 // Any.value
)

// outgoing is a workload to send, with the on-demand name it answers
// ("" when none).
type outgoing struct {
	w     *workload.Workload
	alias string
}

// wireResponse is a DeltaDiscoveryResponse written in its wire form by the
// server: grpcserver's codec sends its bytes as they are, and gRPC hands
// its buffer back to responseBuffers once written. Resources are written
// directly rather than built as a Resource and an Any each only to be
// walked by the generic marshaller: at 100k workloads that walk was the
// largest cost of the initial snapshot. A receiver cannot tell the result
// from the generated encoding.
type wireResponse struct{ buf mem.Buffer }

func (r wireResponse) EncodedMessage() mem.BufferSlice { return mem.BufferSlice{r.buf} }

// bytes are the response's bytes (for tests: the stream hands it to gRPC).
func (r wireResponse) bytes() []byte { return r.buf.ReadOnlyData() }

// newResponse writes a response carrying out and removed into a buffer of
// buffers.
func newResponse(buffers *responseBuffers, typeURL, nonce string, out []outgoing, removed []string) wireResponse {
	b := buffers.take()
	b = appendResources(b, typeURL, out)
	b = protowire.AppendTag(b, responseTypeURLField, protowire.BytesType)
	b = protowire.AppendString(b, typeURL)
	b = protowire.AppendTag(b, responseNonceField, protowire.BytesType)
	b = protowire.AppendString(b, nonce)
	for _, name := range removed {
		b = protowire.AppendTag(b, responseRemovedField, protowire.BytesType)
		b = protowire.AppendString(b, name)
	}
	return wireResponse{buf: mem.NewBuffer(&b, buffers)}
}

// responseBuffers are the buffers of responses gRPC has written, for the
// next ones (a mem.BufferPool, to gRPC): a few large ones, kept whatever
// the collector does (a sync.Pool handed none back across the stream's
// and the sender's goroutines).
type responseBuffers struct{ free chan *[]byte }

// Large buffers only are kept (a response of 1000 resources takes about
// 250 KB), and not beyond what one such response needs; as many as two
// streams' initial snapshots use at a time.
const (
	minPooledResponse  = 16 << 10
	maxPooledResponse  = 1 << 20
	responseBufferStep = 64 << 10
	pooledResponses    = 4
)

func newResponseBuffers() *responseBuffers {
	return &responseBuffers{free: make(chan *[]byte, pooledResponses)}
}

// take returns an empty buffer, kept or nil.
func (p *responseBuffers) take() []byte {
	select {
	case b := <-p.free:
		return (*b)[:0]
	default:
		return nil
	}
}

// Get implements mem.BufferPool.
func (p *responseBuffers) Get(length int) *[]byte {
	b := p.take()
	if cap(b) < length {
		b = make([]byte, length)
	}
	b = b[:length]
	return &b
}

// Put implements mem.BufferPool: gRPC has written the response.
func (p *responseBuffers) Put(b *[]byte) {
	if c := cap(*b); c < minPooledResponse || c > maxPooledResponse {
		return
	}
	select {
	case p.free <- b:
	default:
	}
}

// appendResources appends out as repeated DeltaDiscoveryResponse.resources
// fields: for each, Resource{version, resource: Any{type_url, value}, name,
// aliases}, in field order as the deterministic marshaller writes them.
func appendResources(b []byte, typeURL string, out []outgoing) []byte {
	size := 0
	for _, o := range out {
		n := resourceSize(typeURL, o, hexLen(o.w.Version))
		size += protowire.SizeTag(responseResourcesField) + protowire.SizeBytes(n)
	}
	if cap(b)-len(b) < size {
		// Rounded up, so that the buffer serves the responses after this
		// one too, which differ in size by a few bytes (responseBuffers).
		b = slices.Grow(b, (len(b)+size+responseBufferStep-1)/responseBufferStep*responseBufferStep-len(b))
	}
	var versions [16]byte
	for _, o := range out {
		version := strconv.AppendUint(versions[:0], o.w.Version, 16)
		b = protowire.AppendTag(b, responseResourcesField, protowire.BytesType)
		b = protowire.AppendVarint(b, uint64(resourceSize(typeURL, o, len(version))))
		b = protowire.AppendTag(b, resourceVersionField, protowire.BytesType)
		b = protowire.AppendBytes(b, version)
		b = protowire.AppendTag(b, resourceResourceField, protowire.BytesType)
		b = protowire.AppendVarint(b, uint64(anySize(typeURL, o.w.Resource)))
		b = protowire.AppendTag(b, anyTypeURLField, protowire.BytesType)
		b = protowire.AppendString(b, typeURL)
		b = protowire.AppendTag(b, anyValueField, protowire.BytesType)
		b = protowire.AppendString(b, o.w.Resource)
		b = protowire.AppendTag(b, resourceNameField, protowire.BytesType)
		b = protowire.AppendString(b, o.w.UID())
		if o.alias != "" {
			b = protowire.AppendTag(b, resourceAliasesField, protowire.BytesType)
			b = protowire.AppendString(b, o.alias)
		}
	}
	return b
}

// hexLen is the length of v written in hexadecimal.
func hexLen(v uint64) int { return max(1, (bits.Len64(v)+3)/4) }

func resourceSize(typeURL string, o outgoing, versionLen int) int {
	n := protowire.SizeTag(resourceVersionField) + protowire.SizeBytes(versionLen) +
		protowire.SizeTag(resourceResourceField) + protowire.SizeBytes(anySize(typeURL, o.w.Resource)) +
		protowire.SizeTag(resourceNameField) + protowire.SizeBytes(len(o.w.UID()))
	if o.alias != "" {
		n += protowire.SizeTag(resourceAliasesField) + protowire.SizeBytes(len(o.alias))
	}
	return n
}

func anySize(typeURL string, value string) int {
	return protowire.SizeTag(anyTypeURLField) + protowire.SizeBytes(len(typeURL)) +
		protowire.SizeTag(anyValueField) + protowire.SizeBytes(len(value))
}
