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

// Keep checks and writes in one transaction: on disk first, so that a
// row the table shows is one a restarted agent still knows. The table
// has it even when the disk refuses it (the error says so): the running
// agent needs it now.
func (r reports) Keep(row *tables.CNIPod, check func(statedb.ReadTxn) error) error {
	wtxn := r.db.WriteTxn(r.cniPods)
	defer wtxn.Abort()
	if check != nil {
		if err := check(wtxn); err != nil {
			return err
		}
	}
	err := validContainerID(row.ContainerID)
	if err == nil {
		err = r.store.save(row)
	}
	r.cniPods.Insert(wtxn, row)
	wtxn.Commit()
	return err
}

// Drop removes the row from the table and the disk.
func (r reports) Drop(row *tables.CNIPod) error {
	wtxn := r.db.WriteTxn(r.cniPods)
	r.cniPods.Delete(wtxn, row)
	wtxn.Commit()
	if validContainerID(row.ContainerID) != nil {
		return nil // never on disk
	}
	return r.store.remove(row.ContainerID)
}
