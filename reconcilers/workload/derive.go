// SPDX-License-Identifier: Apache-2.0

package workload

import (
	"context"
	"fmt"
	"hash/fnv"
	"log/slog"
	"math"
	"strings"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"google.golang.org/protobuf/proto"
	"istio.io/istio/pkg/workloadapi"

	"github.com/mtlsbridge/mtlsbridge/reconcilers"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/enrollment"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/readiness"
	"github.com/mtlsbridge/mtlsbridge/spiffe"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

type derivationParams struct {
	cell.In

	Config      Config
	Enrollment  enrollment.Config
	Log         *slog.Logger
	DB          *statedb.DB
	Jobs        job.Registry
	Health      cell.Health
	LocalNode   tables.LocalNode
	Pods        statedb.Table[*tables.Pod]
	CNIPods     statedb.Table[*tables.CNIPod]
	Enrollments statedb.Table[*enrollment.Enrollment]
	// Ready says which of this node's pods are really redirected.
	Ready     statedb.Table[*readiness.ReadyAnnotation]
	Workloads statedb.RWTable[*Workload]
	Digests   *Digests
}

// derivation keeps one Workload per enrolled pod, following the changes of
// enrollments (who is in), pods and CNI reports (addresses) and readiness.
type derivation struct {
	derivationParams
	*reconcilers.Incremental[string]
	// digest is the table's, kept as rows come and go.
	digest Digest
}

func newDerivation(p derivationParams) (*derivation, error) {
	d := &derivation{derivationParams: p}
	wtxn := p.DB.WriteTxn(p.Pods, p.CNIPods, p.Enrollments, p.Ready, p.Workloads)
	defer wtxn.Abort()
	// Each change dirties its pod ("namespace/name").
	pods, err := reconcilers.Follow(wtxn, p.Pods, func(_ statedb.ReadTxn, c statedb.Change[*tables.Pod], dirty map[string]struct{}) {
		dirty[c.Object.Key()] = struct{}{}
	})
	if err != nil {
		return nil, err
	}
	cniPods, err := reconcilers.Follow(wtxn, p.CNIPods, func(_ statedb.ReadTxn, c statedb.Change[*tables.CNIPod], dirty map[string]struct{}) {
		dirty[c.Object.Pod] = struct{}{}
	})
	if err != nil {
		return nil, err
	}
	enrollments, err := reconcilers.Follow(wtxn, p.Enrollments, func(_ statedb.ReadTxn, c statedb.Change[*enrollment.Enrollment], dirty map[string]struct{}) {
		dirty[c.Object.Key()] = struct{}{}
	})
	if err != nil {
		return nil, err
	}
	ready, err := reconcilers.Follow(wtxn, p.Ready, func(_ statedb.ReadTxn, c statedb.Change[*readiness.ReadyAnnotation], dirty map[string]struct{}) {
		dirty[c.Object.Pod] = struct{}{}
	})
	if err != nil {
		return nil, err
	}
	d.Incremental = reconcilers.NewIncremental(p.DB, p.Workloads, p.Workloads.RegisterInitializer(wtxn, "workload"),
		d.update, pods, cniPods, enrollments, ready)
	d.Digests.Publish(p.Workloads.Revision(wtxn.Commit()), d.digest)
	return d, nil
}

func (d *derivation) run(ctx context.Context, health cell.Health) error {
	return d.Run(ctx, health, func() string {
		return fmt.Sprintf("%d workloads", d.Workloads.NumObjects(d.DB.ReadTxn()))
	})
}

func (d *derivation) update(dirty map[string]struct{}) {
	wtxn := d.DB.WriteTxn(d.Workloads)
	defer func() { d.Digests.Publish(d.Workloads.Revision(wtxn.Commit()), d.digest) }()
	for key := range dirty {
		ns, name, _ := strings.Cut(key, "/")
		uid := UID(d.Config.ClusterID, ns, name)
		old, _, hadOld := d.Workloads.Get(wtxn, ByUID(uid))
		e, _, found := d.Enrollments.Get(wtxn, enrollment.ByKey(key))
		enrolled := found && e.Enrolled
		pod, _, found := d.Pods.Get(wtxn, tables.PodByKey(key))
		if !found || !enrolled {
			if hadOld {
				d.Workloads.Delete(wtxn, old)
				d.digest.Remove(old)
			}
			continue
		}
		// A local pod's new sandbox has addresses the API shows later.
		pod = tables.WithPodAddrs(wtxn, d.CNIPods, pod)
		w, err := New(d.Config.ClusterID, d.Enrollment.TrustDomain, pod, d.redirected(wtxn, pod))
		if err != nil {
			d.Log.Error("Cannot encode workload", "pod", key, "error", err)
			continue
		}
		if !hadOld || old.Version != w.Version {
			d.Workloads.Insert(wtxn, w)
			if hadOld {
				d.digest.Remove(old)
			}
			d.digest.Add(w)
		}
	}
}

// redirected tells whether a pod's redirection is really in place: for a
// pod of this node, from this node's datapath tables (an annotation may be
// stale after a restart); for a pod elsewhere, from the annotation its node
// published.
func (d *derivation) redirected(txn statedb.ReadTxn, pod *tables.Pod) bool {
	if pod.NodeName != d.LocalNode.NodeName {
		return pod.RedirectReady
	}
	r, _, found := d.Ready.Get(txn, readiness.ByPod(pod.Key()))
	return found && r.Ready
}

// New encodes the Workload the mTLS agent needs for an enrolled pod (the
// fields README "Delta xDS: the Workload API" lists), with tunnel protocol
// HBONE only when hbone: the pod's redirection is in place.
func New(clusterID, trustDomain string, pod *tables.Pod, hbone bool) (*Workload, error) {
	uid := UID(clusterID, pod.Namespace, pod.Name)
	w := &workloadapi.Workload{
		Uid:               uid,
		Name:              pod.Name,
		Namespace:         pod.Namespace,
		Node:              pod.NodeName,
		WorkloadType:      workloadapi.WorkloadType_POD,
		WorkloadName:      workloadName(pod),
		CanonicalName:     canonicalName(pod),
		CanonicalRevision: canonicalRevision(pod),
		Status:            workloadapi.WorkloadStatus_HEALTHY,
	}
	// Defaults are left out: ztunnel (and the proxy) read an empty trust
	// domain as cluster.local, service account as default and cluster id as
	// Kubernetes. They are up to 36 bytes of every Workload the agent holds
	// for every enrolled pod of the cluster.
	if trustDomain != spiffe.DefaultTrustDomain {
		w.TrustDomain = trustDomain
	}
	if sa := pod.ServiceAccountOrDefault(); sa != tables.DefaultServiceAccount {
		w.ServiceAccount = sa
	}
	if clusterID != DefaultClusterID {
		w.ClusterId = clusterID
	}
	if hbone {
		w.TunnelProtocol = workloadapi.TunnelProtocol_HBONE
	}
	for _, ip := range pod.IPs {
		w.Addresses = append(w.Addresses, ip.AsSlice())
	}
	addr := &workloadapi.Address{Type: &workloadapi.Address_Workload{Workload: w}}
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(addr)
	if err != nil {
		return nil, err
	}
	h := fnv.New64a()
	h.Write(b)
	resource := string(b)
	// The uid field is in the resource (nothing before it can hold
	// "//Pod/"): the row points at it.
	at := strings.Index(resource, uid)
	switch {
	case at < 0:
		return nil, fmt.Errorf("uid %.100q not found in its encoded workload", uid)
	case at+len(uid) > math.MaxUint16:
		return nil, fmt.Errorf("uid %.100q: %d bytes, more than a workload row can point at", uid, len(uid))
	}
	return &Workload{Resource: resource, Version: h.Sum64(), uidAt: uint16(at), uidLen: uint16(len(uid)), HBONE: hbone}, nil
}

// Canonical names as Istio derives them from the recommended labels.
func canonicalName(pod *tables.Pod) string {
	for _, l := range []string{"service.istio.io/canonical-name", "app.kubernetes.io/name", "app"} {
		if v := pod.Labels.Get(l); v != "" {
			return v
		}
	}
	return workloadName(pod)
}

func canonicalRevision(pod *tables.Pod) string {
	for _, l := range []string{"service.istio.io/canonical-revision", "app.kubernetes.io/version", "version"} {
		if v := pod.Labels.Get(l); v != "" {
			return v
		}
	}
	return "latest"
}

// workloadName is the pod's name without the generated suffixes of a
// ReplicaSet pod ("web-7d9f8b6c5-x2x4z" -> "web"), else the pod name.
func workloadName(pod *tables.Pod) string {
	if hash := pod.Labels.Get("pod-template-hash"); hash != "" {
		if i := strings.Index(pod.Name, "-"+hash+"-"); i > 0 {
			return pod.Name[:i]
		}
	}
	return pod.Name
}
