// SPDX-License-Identifier: Apache-2.0

package xds

import (
	"strconv"
	"strings"
	"time"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"

	"github.com/mtlsbridge/mtlsbridge/tables"
)

// ClientsTableName is the name of the table of xDS streams.
const ClientsTableName = "xds-clients"

// Client is one delta xDS stream: who is connected, what it subscribed to,
// and what it acknowledged or rejected.
type Client struct {
	ID   uint64 `json:"id"`
	Peer string `json:"peer"`
	// Pod is the caller's pod ("namespace/name"), from its token.
	Pod    string `json:"pod"`
	NodeID string `json:"nodeID,omitempty"`
	// Subscriptions per type: "*" for wildcard, else the number of names.
	Subscriptions map[string]string `json:"subscriptions,omitempty"`
	LastAckNonce  string            `json:"lastAckNonce,omitempty"`
	// ResourcesSent counts resources sent on the stream (removals too).
	ResourcesSent int `json:"resourcesSent"`
	// LastNack is the nonce and error detail of the last rejected response.
	LastNack       string    `json:"lastNack,omitempty"`
	Nacks          int       `json:"nacks"`
	ConnectedSince time.Time `json:"connectedSince"`
}

func (c *Client) Scope() tables.Scope { return tables.PodScope(c.Pod, "") }

func (c *Client) TableHeader() []string {
	return []string{"ID", "Pod", "Peer", "NodeID", "Subscriptions", "Acked", "Sent", "Nacks", "LastNack", "Since"}
}

func (c *Client) TableRow() []string {
	var subs []string
	for _, t := range []string{AddressType, AuthorizationType} {
		if s, ok := c.Subscriptions[t]; ok {
			subs = append(subs, shortType(t)+"="+s)
		}
	}
	dash := func(s string) string {
		if s == "" {
			return "-"
		}
		return s
	}
	return []string{
		strconv.FormatUint(c.ID, 10), c.Pod, c.Peer, dash(c.NodeID), dash(strings.Join(subs, ",")),
		dash(c.LastAckNonce), strconv.Itoa(c.ResourcesSent), strconv.Itoa(c.Nacks), dash(c.LastNack),
		c.ConnectedSince.UTC().Format(time.RFC3339),
	}
}

func shortType(typeURL string) string {
	return typeURL[strings.LastIndexByte(typeURL, '.')+1:]
}

var (
	clientIDIndex = statedb.Index[*Client, uint64]{
		Name:       "id",
		FromObject: func(c *Client) index.KeySet { return index.NewKeySet(index.Uint64(c.ID)) },
		FromKey:    index.Uint64,
		FromString: index.Uint64String,
		Unique:     true,
	}

	// ClientByID queries a stream by its ID.
	ClientByID = clientIDIndex.Query
)

// NewClientsTable creates the xds-clients table.
func NewClientsTable(db *statedb.DB) (statedb.RWTable[*Client], error) {
	return statedb.NewTable(db, ClientsTableName, clientIDIndex)
}
