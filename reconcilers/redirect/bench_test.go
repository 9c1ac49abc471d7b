// SPDX-License-Identifier: Apache-2.0

package redirect

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"runtime"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/mtlsbridge/mtlsbridge/bpf"
	"github.com/mtlsbridge/mtlsbridge/internal/heapstat"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// BenchmarkMapUpdates compares writing redirect map entries through the
// statedb reconciler (rows inserted Pending in batches, waited on until
// Done) with a bare loop of update syscalls on the same map. One op is one
// round of benchUpdates entries each way; the metrics give ns per entry for
// both and their ratio.
//
//	go test -run '^$' -bench MapUpdates ./reconcilers/redirect/
func BenchmarkMapUpdates(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("needs root for BPF")
	}
	const benchUpdates = 10000
	objs, err := bpf.Load("")
	if err != nil {
		b.Fatal(err)
	}
	defer objs.Close()
	dp := &bpfDatapath{}
	dp.loaded.Store(&loadedDatapath{objs: objs})

	var (
		db  *statedb.DB
		tbl statedb.RWTable[*Redirect]
		rec reconciler.Reconciler[*Redirect]
	)
	h := hive.New(cell.SimpleHealthCell, job.Cell, statedb.Cell,
		cell.Module("bench", "Benchmark",
			cell.ProvidePrivate(newJobGroup, NewRedirectsTable),
			cell.Invoke(func(p reconciler.Params, d *statedb.DB, t statedb.RWTable[*Redirect]) (err error) {
				db, tbl = d, t
				rec, err = reconciler.Register(p, t, (*Redirect).clone,
					func(r *Redirect, s reconciler.Status) *Redirect { r.Status = s; return r },
					func(r *Redirect) reconciler.Status { return r.Status },
					&MapOps{dp: dp, log: p.Log}, nil, reconciler.WithoutPruning())
				return err
			})))
	log := slog.New(slog.DiscardHandler)
	if err := h.Start(log, context.Background()); err != nil {
		b.Fatal(err)
	}
	defer h.Stop(log, context.Background())

	addrs := make([]netip.Addr, benchUpdates)
	for i := range addrs {
		addrs[i] = netip.AddrFrom4([4]byte{10, 99, byte(i >> 8), byte(i)})
	}
	entry := func(round int) bpf.Entry {
		return bpf.Entry{Kind: bpf.KindEnrolled, Ifindex: 7, MAC: net.HardwareAddr{2, 0, 0, 0, byte(round >> 8), byte(round)}, NetnsID: bpf.NoNetns}
	}

	var syscalls, reconciled time.Duration
	b.ResetTimer()
	for round := range b.N {
		e := entry(2 * round)
		start := time.Now()
		for _, addr := range addrs {
			if err := objs.Redirects.Update(addr, e); err != nil {
				b.Fatal(err)
			}
		}
		syscalls += time.Since(start)

		e = entry(2*round + 1)
		start = time.Now()
		for i := 0; i < len(addrs); i += 1000 {
			wtxn := db.WriteTxn(tbl)
			for _, addr := range addrs[i : i+1000] {
				tbl.Insert(wtxn, &Redirect{Addr: addr, Kind: e.Kind, Ifindex: e.Ifindex, MAC: e.MAC, NetnsID: e.NetnsID, Status: reconciler.StatusPending()})
			}
			wtxn.Commit()
		}
		waitReconciled(b, db, tbl, rec)
		reconciled += time.Since(start)
	}
	b.StopTimer()
	n := float64(b.N * benchUpdates)
	b.ReportMetric(float64(syscalls.Nanoseconds())/n, "ns/syscall-update")
	b.ReportMetric(float64(reconciled.Nanoseconds())/n, "ns/reconciled-update")
	b.ReportMetric(float64(reconciled)/float64(syscalls), "reconciler/syscall")
}

func waitReconciled(b *testing.B, db *statedb.DB, tbl statedb.Table[*Redirect], rec reconciler.Reconciler[*Redirect]) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	until := tbl.Revision(db.ReadTxn())
	// No update fails here, so there is no retry to wait for.
	if _, _, err := rec.WaitUntilReconciled(ctx, until); err != nil {
		b.Fatal(err)
	}
}

// BenchmarkMemoryPerLocalPod reports the heap the node keeps per pod of its
// own, beside the cluster-wide tables (BenchmarkMemoryPerPod in
// reconcilers/enrollment, resources-B/workload of BenchmarkXDSMemory): the
// pod's CNI report, its redirect entry and its interface's attachment, with
// their indexes, in rows shaped as the CNI server and the derivation write
// them (one IPv4 address, a ready redirect).
//
//	go test -run '^$' -bench MemoryPerLocalPod ./reconcilers/redirect/
func BenchmarkMemoryPerLocalPod(b *testing.B) {
	const pods = 10_000
	var perPod float64
	for b.Loop() {
		before := heapstat.Settled()
		db := statedb.New()
		cniPods, err := tables.NewCNIPodsTable(db)
		if err != nil {
			b.Fatal(err)
		}
		redirects, err := NewRedirectsTable(db)
		if err != nil {
			b.Fatal(err)
		}
		attachments, err := NewAttachmentsTable(db)
		if err != nil {
			b.Fatal(err)
		}
		txn := db.WriteTxn(cniPods, redirects, attachments)
		for i := range pods {
			pod := fmt.Sprintf("ns-%d/pod-%d", i%100, i)
			addr := netip.AddrFrom4([4]byte{10, 0, byte(i >> 8), byte(i)})
			device := fmt.Sprintf("lxc%011x", i)
			cniPods.Insert(txn, &tables.CNIPod{
				ContainerID: fmt.Sprintf("%064x", i), Pod: pod, UID: fmt.Sprintf("8a3f1c2e-0000-4000-8000-%012x", i),
				IPs: []netip.Addr{addr}, Netns: fmt.Sprintf("/var/run/netns/cni-8a3f1c2e-0000-4000-8000-%012x", i), IfName: "eth0",
				Enrolled: true, Reason: "namespace label", Redirect: "ready", State: tables.CNIStateAllowed, Updated: time.Now(),
			})
			redirects.Insert(txn, &Redirect{
				Addr: addr, Kind: bpf.KindEnrolled, Pod: pod, Interface: device, Ifindex: uint32(100 + i),
				MAC: net.HardwareAddr{2, 0, 0, 0, byte(i >> 8), byte(i)}, NetnsID: bpf.NoNetns, Status: reconciler.StatusDone(),
			})
			attachments.Insert(txn, &Attachment{Device: device, Ifindex: 100 + i, Hook: bpf.HookFromPod, Pod: pod, Status: reconciler.StatusDone()})
		}
		txn.Commit()
		perPod = float64(heapstat.Settled()-before) / pods
		runtime.KeepAlive(db)
	}
	b.ReportMetric(perPod, "B/pod")
}
