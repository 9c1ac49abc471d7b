// SPDX-License-Identifier: Apache-2.0

package proxy

import "istio.io/istio/pkg/workloadapi/security"

// PutPolicyForTest inserts a policy as xDS would.
func PutPolicyForTest(s *State, name string, p *security.Authorization) { s.putPolicy(name, p) }
