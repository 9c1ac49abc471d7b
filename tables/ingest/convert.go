// SPDX-License-Identifier: Apache-2.0

package ingest

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"unique"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/mtlsbridge/mtlsbridge/tables"
)

// The object kinds mtlsbridge reads.
var (
	podGVK       = corev1.SchemeGroupVersion.WithKind("Pod")
	namespaceGVK = corev1.SchemeGroupVersion.WithKind("Namespace")
	nodeGVK      = corev1.SchemeGroupVersion.WithKind("Node")
	cnpGVK       = ciliumV2.WithKind("CiliumNetworkPolicy")
	ccnpGVK      = ciliumV2.WithKind("CiliumClusterwideNetworkPolicy")
	cepGVK       = ciliumV2.WithKind("CiliumEndpoint")
	listGVK      = corev1.SchemeGroupVersion.WithKind("List")

	ciliumV2 = schema.GroupVersion{Group: "cilium.io", Version: "v2"}
)

// errUnknownKind is returned for manifest objects of a kind mtlsbridge does not read.
var errUnknownKind = errors.New("unsupported kind (mtlsbridge reads v1 Pod, Namespace, Node and cilium.io/v2 CiliumNetworkPolicy, CiliumClusterwideNetworkPolicy, CiliumEndpoint)")

// decode turns one manifest object into a table row. A row may come back
// together with an error when part of the object was malformed; the row is
// still used.
func decode(u *unstructured.Unstructured) (any, error) {
	if u.GetName() == "" {
		return nil, fmt.Errorf("%s without metadata.name", u.GetKind())
	}
	namespace := u.GetNamespace()
	if namespace == "" {
		namespace = corev1.NamespaceDefault
	}
	switch gvk := u.GroupVersionKind(); gvk {
	case podGVK:
		var pod corev1.Pod
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, &pod); err != nil {
			return nil, fmt.Errorf("pod %s/%s: %w", namespace, u.GetName(), err)
		}
		pod.Namespace = namespace
		return podFromK8s(&pod)
	case namespaceGVK:
		return tables.NewNamespace(u.GetName(), u.GetLabels(), u.GetAnnotations()), nil
	case nodeGVK:
		var node corev1.Node
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, &node); err != nil {
			return nil, fmt.Errorf("node %s: %w", u.GetName(), err)
		}
		return nodeFromK8s(&node), nil
	case cnpGVK:
		return tables.ParsePolicy(tables.KindCNP, namespace, u.GetName(), u.Object), nil
	case ccnpGVK:
		return tables.ParsePolicy(tables.KindCCNP, "", u.GetName(), u.Object), nil
	case cepGVK:
		return endpointFromUnstructured(u)
	default:
		return nil, fmt.Errorf("%s %s %q: %w", gvk.GroupVersion(), gvk.Kind, u.GetName(), errUnknownKind)
	}
}

// podFromK8s keeps the fields of a pod that mtlsbridge uses. An address that
// does not parse is left out and reported.
//
// Strings that many pods share (namespace, node, service account, phase,
// and the labels, which replicas have in common) are interned: the decoder
// gives every pod copies of its own, tens of bytes each at 100,000 pods.
func podFromK8s(p *corev1.Pod) (*tables.Pod, error) {
	pod := &tables.Pod{
		Namespace:          intern(p.Namespace),
		Name:               p.Name,
		UID:                string(p.UID),
		NodeName:           intern(p.Spec.NodeName),
		ServiceAccount:     intern(p.Spec.ServiceAccountName),
		Labels:             tables.NewLabels(p.Labels).Interned(),
		HostNetwork:        p.Spec.HostNetwork,
		Phase:              intern(string(p.Status.Phase)),
		RedirectReady:      p.Annotations[tables.RedirectAnnotation] == tables.RedirectReadyValue,
		SourceIPUnverified: tables.AnnotationTrue(p.Annotations, tables.DisableSourceIPVerificationAnnotation),
	}
	var errs []error
	addIP := func(s string) {
		ip, err := tables.ParsePodAddr(s)
		if err != nil {
			errs = append(errs, fmt.Errorf("pod %s: bad IP %q: %w", pod.Key(), s, err))
			return
		}
		for _, have := range pod.IPs {
			if have == ip {
				return
			}
		}
		pod.IPs = append(pod.IPs, ip)
	}
	for _, ip := range p.Status.PodIPs {
		addIP(ip.IP)
	}
	if len(p.Status.PodIPs) == 0 && p.Status.PodIP != "" {
		addIP(p.Status.PodIP)
	}
	return pod, errors.Join(errs...)
}

// intern returns the copy of s that rows converted since the last garbage
// collection share (no handle is kept, so a collection lets the runtime
// forget it, and the next row makes a new one): one copy a collection
// cycle instead of one a row, and never more than before.
func intern(s string) string { return unique.Make(s).Value() }

// keepSharedText gives an updated pod the text of its previous row where
// it did not change. That text is shared with the rows interned in the
// same collection cycle; the update's own interned copy would be shared
// only with rows of its cycle, so without this, sharing would fade as
// pods are updated one by one.
func keepSharedText(old, pod *tables.Pod) {
	keep := func(s *string, prev string) {
		if *s == prev {
			*s = prev
		}
	}
	keep(&pod.Namespace, old.Namespace)
	keep(&pod.NodeName, old.NodeName)
	keep(&pod.ServiceAccount, old.ServiceAccount)
	keep(&pod.Phase, old.Phase)
	if pod.Labels == old.Labels {
		pod.Labels = old.Labels
	}
}

func nodeFromK8s(n *corev1.Node) *tables.Node {
	node := &tables.Node{Name: n.Name, Labels: tables.NewLabels(n.Labels)}
	for _, a := range n.Status.Addresses {
		if a.Type != corev1.NodeInternalIP {
			continue
		}
		if ip, err := netip.ParseAddr(a.Address); err == nil && !slices.Contains(node.Addresses, ip.Unmap()) {
			node.Addresses = append(node.Addresses, ip.Unmap())
		}
	}
	return node
}

// endpointFromUnstructured reads status.identity.id of a CiliumEndpoint; the
// identity stays 0 until Cilium has allocated one.
func endpointFromUnstructured(u *unstructured.Unstructured) (*ciliumEndpoint, error) {
	ep := &ciliumEndpoint{Namespace: u.GetNamespace(), Name: u.GetName()}
	if ep.Namespace == "" {
		ep.Namespace = corev1.NamespaceDefault
	}
	raw, found, err := unstructured.NestedFieldNoCopy(u.Object, "status", "identity", "id")
	if err != nil || !found {
		return ep, nil
	}
	var id int64
	switch v := raw.(type) {
	case int64:
		id = v
	case float64:
		id = int64(v)
	default:
		return ep, fmt.Errorf("ciliumendpoint %s: status.identity.id is %T, want a number", ep.Key(), raw)
	}
	if id <= 0 || id > 1<<32-1 {
		return ep, fmt.Errorf("ciliumendpoint %s: status.identity.id %d out of range", ep.Key(), id)
	}
	ep.Identity = uint32(id)
	return ep, nil
}
