// SPDX-License-Identifier: Apache-2.0

package redirect_test

import (
	"testing"

	"github.com/mtlsbridge/mtlsbridge/reconcilers/redirect"
	"github.com/mtlsbridge/mtlsbridge/tables"
)

// The rows of a sandbox kept steered after its pod left name no pod, but
// `db show --pod` still finds them under the pod they belonged to.
func TestKeptRowsScopeToTheirFormerPod(t *testing.T) {
	want := tables.Scope{Namespace: "app", Pod: "app/web-0"}
	if got := (&redirect.Redirect{FormerPod: "app/web-0"}).Scope(); got != want {
		t.Errorf("kept redirect's scope: %+v, want %+v", got, want)
	}
	if got := (&redirect.Attachment{FormerPod: "app/web-0"}).Scope(); got != want {
		t.Errorf("kept attachment's scope: %+v, want %+v", got, want)
	}
	if got := (&redirect.Redirect{Pod: "app/web-0"}).Scope(); got != want {
		t.Errorf("live redirect's scope: %+v, want %+v", got, want)
	}
}
