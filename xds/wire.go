// SPDX-License-Identifier: Apache-2.0

package xds

import (
	"math/bits"
	"slices"
	"strconv"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/protobuf/encoding/protowire"

	"github.com/mtlsbridge/mtlsbridge/reconcilers/workload"
)

// Field numbers of the messages the server writes by hand (envoy's
// discovery.proto and google.protobuf.Any).
const (
	responseResourcesField = 2 // DeltaDiscoveryResponse.resources

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

// responseBuffers are buffers of responses sent, for the next ones: a
// few, kept whatever the collector does (a sync.Pool would lose them).
type responseBuffers chan []byte

// Large buffers only are kept (a response of up to 1000 resources takes
// about 250 KB), and not beyond what one such response needs; as many as
// two streams' initial snapshots use at a time.
const (
	minPooledResponse  = 16 << 10
	maxPooledResponse  = 1 << 20
	responseBufferStep = 64 << 10
	pooledResponses    = 4
)

func newResponseBuffers() responseBuffers { return make(responseBuffers, pooledResponses) }

func (p responseBuffers) get() []byte {
	select {
	case b := <-p:
		return b
	default:
		return nil
	}
}

// put takes back the buffer of a response that gRPC has marshalled (its
// SendMsg returned): nothing refers to its bytes any more.
func (p responseBuffers) put(resp *discovery.DeltaDiscoveryResponse) {
	b := resp.ProtoReflect().GetUnknown()
	if c := cap(b); c < minPooledResponse || c > maxPooledResponse {
		return
	}
	select {
	case p <- b[:0]:
	default:
	}
}

// newResponse builds a response carrying out, written into buf. The resources are written
// directly in their wire form and attached as the response's unknown
// fields, which protobuf marshals verbatim: a receiver cannot tell them
// from the generated encoding (fields may come in any order and repeated
// fields concatenate), and the server skips building, for every resource,
// a Resource and an Any only to have them walked by the generic marshaller.
// At 100k workloads that walk was the largest cost of the initial snapshot.
func newResponse(typeURL, nonce string, out []outgoing, removed []string, buf []byte) *discovery.DeltaDiscoveryResponse {
	resp := &discovery.DeltaDiscoveryResponse{TypeUrl: typeURL, Nonce: nonce, RemovedResources: removed}
	if len(out) > 0 {
		resp.ProtoReflect().SetUnknown(appendResources(buf, typeURL, out))
	}
	return resp
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
		if len(o.w.Resource) > 0 {
			b = protowire.AppendTag(b, anyValueField, protowire.BytesType)
			b = protowire.AppendString(b, o.w.Resource)
		}
		b = protowire.AppendTag(b, resourceNameField, protowire.BytesType)
		b = protowire.AppendString(b, o.w.UID)
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
		protowire.SizeTag(resourceNameField) + protowire.SizeBytes(len(o.w.UID))
	if o.alias != "" {
		n += protowire.SizeTag(resourceAliasesField) + protowire.SizeBytes(len(o.alias))
	}
	return n
}

func anySize(typeURL string, value string) int {
	n := protowire.SizeTag(anyTypeURLField) + protowire.SizeBytes(len(typeURL))
	if len(value) > 0 {
		n += protowire.SizeTag(anyValueField) + protowire.SizeBytes(len(value))
	}
	return n
}
