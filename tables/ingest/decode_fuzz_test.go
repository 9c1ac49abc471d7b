// SPDX-License-Identifier: Apache-2.0

package ingest

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/mtlsbridge/mtlsbridge/tables"
)

// FuzzDecodeManifests feeds arbitrary manifest files, of every kind the
// agent reads and any other, to the decoder the manifest folder uses
// (whoever may write the folder controls them). It must never panic; a
// file is either refused whole with an error, or gives table rows and an
// error for each object it skips. Seeds: the demo manifests and
// testdata/fuzz/FuzzDecodeManifests. Long runs: make fuzz.
func FuzzDecodeManifests(f *testing.F) {
	demo, _ := filepath.Glob("../../testdata/demo/*.yaml")
	for _, name := range demo {
		b, err := os.ReadFile(name)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte("apiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: Pod\n  metadata: {name: a}\n  status: {podIPs: [{ip: 10.0.0.1}, {ip: nonsense}]}\n"))
	f.Add([]byte("a: &a [*a, *a]\n"))
	f.Add([]byte("---\n- 1\n---\nkind: Pod\n"))
	f.Fuzz(func(t *testing.T, content []byte) {
		if len(content) > 1<<16 {
			t.Skip("larger files are no different, only slower")
		}
		objs, docs, objErrs, err := decodeManifests(content)
		if err != nil {
			if objs != nil || objErrs != nil {
				t.Fatalf("a refused file still gave objects %v or errors %v", objs, objErrs)
			}
			return
		}
		if len(objs) != len(docs) {
			t.Fatalf("%d objects from %d documents", len(objs), len(docs))
		}
		for _, e := range objErrs {
			if e == nil || e.Error() == "" {
				t.Fatal("an object skipped without saying why")
			}
		}
		for _, o := range objs {
			switch o.(type) {
			case *tables.Pod, *tables.Namespace, *tables.Node, *tables.Policy, *ciliumEndpoint:
			default:
				t.Fatalf("decoded a %T", o)
			}
		}
	})
}
