// SPDX-License-Identifier: Apache-2.0

package grpcserver

import (
	"google.golang.org/grpc"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
)

// Encoded is a message its service wrote in wire form itself. The server
// sends its bytes as they are: gRPC's codec would copy them into a buffer
// of its own (cleared first) for nothing. gRPC owns them from SendMsg on
// and frees them (mem.Buffer) once written.
type Encoded interface {
	EncodedMessage() mem.BufferSlice
}

// Retained is a message its service reads in wire form itself, where gRPC
// received it: it is handed gRPC's receive buffers rather than decoded
// (and copied) by gRPC's proto codec. gRPC frees them when Retain returns:
// what it keeps, it keeps with a reference of its own (mem.BufferSlice.Ref).
type Retained interface {
	Retain(data mem.BufferSlice)
}

// codec is gRPC's proto codec, except for Encoded and Retained messages.
type codec struct{ encoding.CodecV2 }

func (c codec) Unmarshal(data mem.BufferSlice, v any) error {
	if r, ok := v.(Retained); ok {
		r.Retain(data)
		return nil
	}
	return c.CodecV2.Unmarshal(data, v)
}

func (c codec) Marshal(v any) (mem.BufferSlice, error) {
	if e, ok := v.(Encoded); ok {
		return e.EncodedMessage(), nil
	}
	return c.CodecV2.Marshal(v)
}

// CodecOption makes a gRPC server send Encoded messages as they are, and
// hand Retained ones their bytes.
func CodecOption() grpc.ServerOption {
	return grpc.ForceServerCodecV2(codec{encoding.GetCodecV2(proto.Name)})
}
