// SPDX-License-Identifier: Apache-2.0

package identity

import (
	"time"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
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

	// CertificateBySerial queries a certificate by its serial (hex).
	CertificateBySerial = certificateSerialIndex.Query
)

// NewCertificatesTable creates the certificates table.
func NewCertificatesTable(db *statedb.DB) (statedb.RWTable[*Certificate], error) {
	return statedb.NewTable(db, CertificatesTableName, certificateSerialIndex)
}
