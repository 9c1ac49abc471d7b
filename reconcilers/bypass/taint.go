// SPDX-License-Identifier: Apache-2.0

package bypass

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/retry"

	"github.com/mtlsbridge/mtlsbridge/api"
	"github.com/mtlsbridge/mtlsbridge/tables"
	"github.com/mtlsbridge/mtlsbridge/tables/ingest"
)

// ErrTaintNeedsKubernetes: --ready-taint is set without --source=k8s.
var ErrTaintNeedsKubernetes = errors.New("--ready-taint needs --source=k8s")

// parseTaint reads "KEY:EFFECT" (as kubectl taint writes it, a value
// "KEY=VALUE:EFFECT" is accepted and ignored: the key and effect match).
func parseTaint(s string) (key string, effect corev1.TaintEffect, err error) {
	k, e, ok := strings.Cut(s, ":")
	k, _, _ = strings.Cut(k, "=")
	switch corev1.TaintEffect(e) {
	case corev1.TaintEffectNoSchedule, corev1.TaintEffectPreferNoSchedule, corev1.TaintEffectNoExecute:
	default:
		ok = false
	}
	if !ok || k == "" {
		return "", "", fmt.Errorf("--ready-taint=%q: want KEY:EFFECT, EFFECT one of NoSchedule, PreferNoSchedule, NoExecute", s)
	}
	return k, corev1.TaintEffect(e), nil
}

// removeTaint removes the taint of key and effect from the node, if it
// has it. It reports whether it removed one.
func removeTaint(ctx context.Context, kube kubernetes.Interface, node, key string, effect corev1.TaintEffect) (bool, error) {
	removed := false
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		n, err := kube.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
		if err != nil {
			return err
		}
		keep := n.Spec.Taints[:0:0]
		for _, t := range n.Spec.Taints {
			if t.Key != key || t.Effect != effect {
				keep = append(keep, t)
			}
		}
		if len(keep) == len(n.Spec.Taints) {
			return nil
		}
		n.Spec.Taints = keep
		if _, err := kube.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{}); err != nil {
			return err
		}
		removed = true
		return nil
	})
	return removed, err
}

type taintParams struct {
	cell.In

	Config  Config
	Node    tables.LocalNode
	Checker *Checker
	Jobs    job.Group
	Log     *slog.Logger
	Mode    ingest.Mode     `optional:"true"`
	Clients *ingest.Clients `optional:"true"`
	State   *taintState
}

// taintState is what the removal of --ready-taint found last.
type taintState struct{ err atomic.Pointer[error] }

func (s *taintState) Err() error {
	if p := s.err.Load(); p != nil {
		return *p
	}
	return nil
}

// registerTaintRemoval removes --ready-taint from this node once the
// agent is ready, so that pods are scheduled only to nodes whose agent
// redirects them.
func registerTaintRemoval(p taintParams) error {
	if p.Config.ReadyTaint == "" {
		return nil
	}
	key, effect, err := parseTaint(p.Config.ReadyTaint)
	if err != nil {
		return err
	}
	if p.Mode != ingest.Kubernetes {
		return ErrTaintNeedsKubernetes
	}
	state := p.State
	p.Jobs.Add(job.OneShot("remove-ready-taint", func(ctx context.Context, health cell.Health) error {
		health.OK("waiting until ready")
		select {
		case <-ctx.Done():
			return nil
		case <-p.Checker.Ready():
		}
		backoff := time.Second
		for attempt := 1; ; attempt++ {
			removed, err := removeTaint(ctx, p.Clients.Kube, p.Node.NodeName, key, effect)
			if err == nil {
				state.err.Store(&err)
				if removed {
					p.Log.Info("Ready: node taint removed", "node", p.Node.NodeName, "taint", p.Config.ReadyTaint)
				}
				health.OK("taint " + p.Config.ReadyTaint + " absent")
				return nil
			}
			err = fmt.Errorf("cannot remove taint %s from node %s: %w", p.Config.ReadyTaint, p.Node.NodeName, err)
			state.err.Store(&err)
			health.Degraded("cannot remove taint "+p.Config.ReadyTaint, err)
			// Said at once, then as the backoff grows: a lasting refusal
			// (RBAC, an admission policy) must be visible in the log.
			if attempt == 1 || backoff >= 30*time.Second {
				p.Log.Error("Ready, but the node keeps its readiness taint: no pod is scheduled here", "error", err, "attempt", attempt)
			}
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, 30*time.Second)
		}
	}))
	return nil
}

// taintCheck makes the taint part of readiness: a node that cannot lose
// it (no permission to update the node) gets no pods, and says why.
func taintCheck(s *taintState) api.CheckOut {
	return api.CheckOut{Check: api.Check{Name: "ready-taint", Err: s.Err}}
}
