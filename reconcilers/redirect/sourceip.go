// SPDX-License-Identifier: Apache-2.0

package redirect

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"

	"github.com/mtlsbridge/mtlsbridge/api"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/enrollment"
	"github.com/mtlsbridge/mtlsbridge/reconcilers/steering"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// ErrSourceIPVerified: Cilium drops what a pod sends from an address that
// is not the pod's own. The mTLS agent of this mode sends with the
// addresses of the pods it carries (HBONE from the source pod's address,
// plain TCP to a local pod from its peer's), so Cilium drops all of it:
// closed, but nothing works, unless Cilium exempts the agent's pod.
var ErrSourceIPVerified = errors.New("Cilium drops what the mTLS agent sends with the pods' addresses")

type sourceIPParams struct {
	cell.In

	Mode        steering.Config `optional:"true"`
	DB          *statedb.DB
	Enrollments statedb.Table[*enrollment.Enrollment]
	Pods        statedb.Table[*tables.Pod]
	Namespaces  statedb.Table[*tables.Namespace]
}

// checkSourceIP warns in /healthz (check cilium-source-ip) when Cilium
// verifies pods' source addresses (enable-source-ip-verification, on by
// default) and this node's mTLS agent pod is not exempt: Cilium v1.20
// exempts a pod annotated DisableSourceIPVerificationAnnotation in a
// namespace annotated DelegateSourceIPVerificationAnnotation. Only with
// --cilium-config-dir, and only in this mode: in-pod, the mTLS agent
// sends from inside each pod with its own address.
func checkSourceIP(p sourceIPParams) api.CheckOut {
	check := func() error {
		if inactive(p.Mode) || p.Mode.CiliumConfigDir == "" {
			return nil
		}
		settings, err := steering.CiliumSettings(p.Mode.CiliumConfigDir, "enable-source-ip-verification")
		if err != nil {
			return err
		}
		// On by default; set, on only when it reads true (as Cilium reads it).
		if v := settings[0]; v != "" {
			if on, err := strconv.ParseBool(v); err != nil || !on {
				return nil
			}
		}
		txn := p.DB.ReadTxn()
		if initialized, _ := p.Namespaces.Initialized(txn); !initialized {
			return nil // the namespace's annotation may not be read yet
		}
		var errs []error
		for e := range p.Enrollments.List(txn, enrollment.OfThisNode()) {
			if !e.MTLSAgent {
				continue
			}
			pod, _, ok := p.Pods.Get(txn, tables.PodByKey(e.Key()))
			if !ok || pod.HostNetwork || pod.Finished() {
				continue
			}
			ns, _, _ := p.Namespaces.Get(txn, tables.NamespaceByName(pod.Namespace))
			var missing []string
			if ns == nil || !ns.SourceIPDelegated {
				missing = append(missing, fmt.Sprintf("namespace %s annotated %s=true", pod.Namespace, tables.DelegateSourceIPVerificationAnnotation))
			}
			if !pod.SourceIPUnverified {
				missing = append(missing, fmt.Sprintf("the pod annotated %s=true", tables.DisableSourceIPVerificationAnnotation))
			}
			if len(missing) > 0 {
				errs = append(errs, fmt.Errorf("%w: mTLS agent pod %s needs %s", ErrSourceIPVerified, pod.Key(), strings.Join(missing, " and ")))
			}
		}
		return errors.Join(errs...)
	}
	return api.CheckOut{Check: api.Check{Name: "cilium-source-ip", Warning: true, Err: check}}
}
