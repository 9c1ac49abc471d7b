// SPDX-License-Identifier: Apache-2.0

package ingest

import (
	"encoding/json"
	"fmt"
	"runtime"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/mtlsbridge/mtlsbridge/internal/heapstat"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// BenchmarkPodRowHeap reports the heap the pods' rows hold, converted from
// API objects decoded one by one as client-go decodes them: 100,000 pods,
// replicas of 2,000 deployments in 200 namespaces on 1,000 nodes. The
// rows alone, without the table's indexes.
func BenchmarkPodRowHeap(b *testing.B) {
	const n, deployments = 100_000, 2_000
	wire := make([][]byte, n)
	for i := range n {
		d := i % deployments
		hash := fmt.Sprintf("%09x", d*7919)[:9]
		pod := corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{
				Namespace: fmt.Sprintf("team-%d", d%200),
				Name:      fmt.Sprintf("service-%d-%s-%05x", d, hash, i),
				UID:       types.UID(fmt.Sprintf("5f1c2e7a-0000-4000-8000-%012x", i)),
				Labels:    map[string]string{"app.kubernetes.io/name": fmt.Sprintf("service-%d", d), "pod-template-hash": hash, "version": "v1"},
			},
			Spec: corev1.PodSpec{
				NodeName:           fmt.Sprintf("ip-10-0-%d-%d.ec2.internal", i%1000/250, i%1000%250),
				ServiceAccountName: fmt.Sprintf("service-%d", d),
			},
			Status: corev1.PodStatus{
				Phase:  corev1.PodRunning,
				PodIPs: []corev1.PodIP{{IP: fmt.Sprintf("10.%d.%d.%d", i>>16, i>>8&255, i&255)}},
			},
		}
		var err error
		if wire[i], err = json.Marshal(&pod); err != nil {
			b.Fatal(err)
		}
	}
	rows := make([]*tables.Pod, n)
	var perPod float64
	for b.Loop() {
		clear(rows)
		before := heapstat.Settled()
		for i, bs := range wire {
			var pod corev1.Pod
			if err := json.Unmarshal(bs, &pod); err != nil {
				b.Fatal(err)
			}
			row, err := podFromK8s(&pod)
			if err != nil {
				b.Fatal(err)
			}
			rows[i] = row
		}
		after := heapstat.Settled()
		runtime.KeepAlive(rows)
		perPod = float64(after-before) / n
	}
	b.ReportMetric(perPod, "B/pod")
}
