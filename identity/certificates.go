// SPDX-License-Identifier: Apache-2.0

package identity

import (
	"slices"
	"time"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"

	"github.com/mtlsbridge/mtlsbridge/tables"
)

// CertificatesTableName is the name of the table of issued certificates.
const CertificatesTableName = "certificates"

// Certificate records one issued workload certificate (CFP-32759: "list the
// names and metadata of certificates requested"). Never its key: the CA
// never sees it.
type Certificate struct {
	Serial   string    `json:"serial"`
	SpiffeID string    `json:"spiffeID"`
	Pod      string    `json:"pod"` // an enrolled pod on this node holding the identity
	IssuedAt time.Time `json:"issuedAt"`
	NotAfter time.Time `json:"notAfter"`
}

func (c *Certificate) Scope() tables.Scope { return tables.PodScope(c.Pod, "") }

func (c *Certificate) TableHeader() []string {
	return []string{"Serial", "SpiffeID", "Pod", "IssuedAt", "NotAfter"}
}

func (c *Certificate) TableRow() []string {
	return []string{c.Serial, c.SpiffeID, c.Pod, c.IssuedAt.UTC().Format(time.RFC3339), c.NotAfter.UTC().Format(time.RFC3339)}
}

var (
	certificateSerialIndex = statedb.Index[*Certificate, string]{
		Name:       "serial",
		FromObject: func(c *Certificate) index.KeySet { return index.NewKeySet(index.String(c.Serial)) },
		FromKey:    index.String,
		FromString: index.FromString,
		Unique:     true,
	}

	certificateIDIndex = statedb.Index[*Certificate, string]{
		Name:       "spiffe-id",
		FromObject: func(c *Certificate) index.KeySet { return index.NewKeySet(tables.ExactKey(c.SpiffeID)) },
		FromKey:    tables.ExactKey,
		FromString: tables.ExactKeyFromString,
	}

	// CertificateBySerial queries a certificate by its serial (hex).
	CertificateBySerial = certificateSerialIndex.Query
	// CertificatesByID queries the certificates of a SPIFFE ID.
	CertificatesByID = certificateIDIndex.Query
)

// keptPerIdentity bounds the rows of one identity: its current certificate
// and those it rotated from lately. An mTLS agent asking in a loop must
// not grow the table until the certificates expire.
const keptPerIdentity = 4

// recordIssued adds an issued certificate, dropping the oldest of its
// identity beyond keptPerIdentity.
func recordIssued(txn statedb.WriteTxn, tbl statedb.RWTable[*Certificate], c *Certificate) {
	tbl.Insert(txn, c)
	rows := slices.Collect(statedb.ToSeq(tbl.List(txn, CertificatesByID(c.SpiffeID))))
	if len(rows) <= keptPerIdentity {
		return
	}
	slices.SortFunc(rows, func(a, b *Certificate) int { return a.IssuedAt.Compare(b.IssuedAt) })
	for _, old := range rows[:len(rows)-keptPerIdentity] {
		tbl.Delete(txn, old)
	}
}

// NewCertificatesTable creates the certificates table.
func NewCertificatesTable(db *statedb.DB) (statedb.RWTable[*Certificate], error) {
	return statedb.NewTable(db, CertificatesTableName, certificateSerialIndex, certificateIDIndex)
}
