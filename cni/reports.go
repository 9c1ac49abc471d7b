// SPDX-License-Identifier: Apache-2.0

package cni

import (
	"github.com/cilium/statedb"

	"github.com/mtlsbridge/mtlsbridge/tables"
)

// reports keeps cni-pods rows: the plugin's reports, and the sandboxes the
// in-pod mode found that no plugin reported (tables.CNIReports).
type reports struct {
	db      *statedb.DB
	cniPods statedb.RWTable[*tables.CNIPod]
	store   *store
}

var _ tables.CNIReports = reports{}

// Keep writes the row on disk, then into the table: a row the table shows
// is one a restarted agent still knows. The table has it even when the
// disk refuses it (the error says so): the running agent needs it now.
func (r reports) Keep(row *tables.CNIPod) error {
	err := validContainerID(row.ContainerID)
	if err == nil {
		err = r.store.save(row)
	}
	wtxn := r.db.WriteTxn(r.cniPods)
	r.cniPods.Insert(wtxn, row)
	wtxn.Commit()
	return err
}
