// SPDX-License-Identifier: Apache-2.0

package ociimage_test

import (
	"archive/tar"
	"debug/buildinfo"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/mtlsbridge/mtlsbridge/internal/ociimage"
)

// build runs what make image runs: a reproducible go build of this tree's
// commands into a folder of the test, then the image.
func build(t *testing.T, revision string, created time.Time) (v1.Image, map[string]string) {
	t.Helper()
	root := gitOutput(t, "rev-parse", "--show-toplevel")
	bins, missing, err := ociimage.BuildBinaries(filepath.Join(runtime.GOROOT(), "bin", "go"), root, t.TempDir(), "linux", runtime.GOARCH, true)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("built %d binaries; not in this tree: %v", len(bins), missing)
	img, err := ociimage.Build(ociimage.Config{
		Binaries: bins, Entrypoint: ociimage.Agent, User: "0:0",
		Revision: revision, Version: "test", Source: "https://example.invalid/mtlsbridge",
		Created: created, OS: "linux", Architecture: runtime.GOARCH,
	})
	if err != nil {
		t.Fatal(err)
	}
	return img, bins
}

func gitOutput(t *testing.T, args ...string) string {
	t.Helper()
	out, err := exec.Command("git", args...).Output()
	if err != nil {
		t.Fatalf("git %v: %v", args, err)
	}
	return strings.TrimSpace(string(out))
}

// TestImage inspects the image make image builds, and builds it a second
// time from scratch (binaries too) to compare digests.
func TestImage(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binaries twice")
	}
	revision := gitOutput(t, "rev-parse", "HEAD")
	created := time.Unix(1780000000, 0).UTC()
	img, bins := build(t, revision, created)
	digest, err := img.Digest()
	must(t, err)

	// Reproducible: a second build in other folders gives the same bytes.
	again, _ := build(t, revision, created)
	if d, err := again.Digest(); err != nil || d != digest {
		t.Errorf("second build: digest %v (%v), first %v", d, err, digest)
	}
	t.Logf("image %s", digest)
	// And the inputs count: another commit or time is another image.
	if other, err := ociimage.Build(ociimage.Config{Binaries: bins, Entrypoint: ociimage.Agent, User: "0:0",
		Revision: "0000000", Created: created, OS: "linux", Architecture: runtime.GOARCH}); err != nil {
		t.Fatal(err)
	} else if d, _ := other.Digest(); d == digest {
		t.Error("another revision gave the same digest")
	}

	// OCI media types, the configuration the runtime reads.
	mt, err := img.MediaType()
	must(t, err)
	if mt != types.OCIManifestSchema1 {
		t.Errorf("manifest media type %s", mt)
	}
	cf, err := img.ConfigFile()
	must(t, err)
	if !slices.Equal(cf.Config.Entrypoint, []string{"/usr/local/bin/mtlsbridge"}) || cf.Config.User != "0:0" ||
		cf.OS != "linux" || cf.Architecture != runtime.GOARCH || !cf.Created.Time.Equal(created) {
		t.Errorf("config: entrypoint %v, user %q, platform %s/%s, created %v", cf.Config.Entrypoint, cf.Config.User, cf.OS, cf.Architecture, cf.Created)
	}
	labels := cf.Config.Labels
	if labels["org.opencontainers.image.revision"] != revision || labels["org.opencontainers.image.created"] != "2026-05-28T20:26:40Z" ||
		labels["org.opencontainers.image.licenses"] != "Apache-2.0" || labels["org.opencontainers.image.title"] != "mtlsbridge" {
		t.Errorf("labels %v", labels)
	}
	for _, h := range cf.History {
		if !h.Created.Time.Equal(created) {
			t.Errorf("history entry %q created %v", h.CreatedBy, h.Created)
		}
	}

	// The files: exactly the base and the binaries, owned by root, every
	// time the commit's, in name order within each layer.
	layers, err := img.Layers()
	must(t, err)
	type entry struct {
		mode    int64
		typ     byte
		content []byte
	}
	files := map[string]entry{}
	for i, l := range layers {
		lmt, err := l.MediaType()
		must(t, err)
		if lmt != types.OCILayer {
			t.Errorf("layer %d media type %s", i, lmt)
		}
		rc, err := l.Uncompressed()
		must(t, err)
		tr := tar.NewReader(rc)
		var names []string
		for {
			h, err := tr.Next()
			if errors.Is(err, io.EOF) {
				break
			}
			must(t, err)
			if h.Uid != 0 || h.Gid != 0 || h.Uname != "" || !h.ModTime.Equal(created) {
				t.Errorf("%s: owner %d:%d %q, time %v", h.Name, h.Uid, h.Gid, h.Uname, h.ModTime)
			}
			data, err := io.ReadAll(tr)
			must(t, err)
			files["/"+strings.TrimSuffix(h.Name, "/")] = entry{h.Mode, h.Typeflag, data}
			names = append(names, h.Name)
		}
		rc.Close()
		if !slices.IsSorted(names) {
			t.Errorf("layer %d entries not sorted: %v", i, names)
		}
	}
	want := map[string]int64{"/etc": 0o755, "/etc/passwd": 0o644, "/etc/group": 0o644, "/root": 0o700, "/tmp": 0o1777,
		"/usr": 0o755, "/usr/local": 0o755, "/usr/local/bin": 0o755}
	for name := range bins {
		want["/usr/local/bin/"+name] = 0o755
	}
	for name, mode := range want {
		if e, ok := files[name]; !ok || e.mode != mode {
			t.Errorf("%s: mode %o (present %v), want %o", name, e.mode, ok, mode)
		}
	}
	for name := range files {
		if _, ok := want[name]; !ok {
			t.Errorf("unexpected file %s in the image", name)
		}
	}
	if !strings.HasPrefix(string(files["/etc/passwd"].content), "root:x:0:0:") {
		t.Errorf("/etc/passwd: %q", files["/etc/passwd"].content)
	}

	// The binaries are the real, static ones: they run here, and the agent
	// reports the commit the image's label names.
	dir := t.TempDir()
	for name := range bins {
		must(t, os.WriteFile(filepath.Join(dir, name), files["/usr/local/bin/"+name].content, 0o755))
	}
	if out, err := exec.Command(filepath.Join(dir, ociimage.Agent), "version").CombinedOutput(); err != nil || !strings.HasPrefix(string(out), "mtlsbridge ") {
		t.Errorf("mtlsbridge version: %q (%v)", out, err)
	}
	info, err := buildinfo.ReadFile(filepath.Join(dir, ociimage.Agent))
	must(t, err)
	settings := map[string]string{}
	for _, s := range info.Settings {
		settings[s.Key] = s.Value
	}
	if settings["-trimpath"] != "true" || settings["CGO_ENABLED"] != "0" || settings["GOOS"] != "linux" {
		t.Errorf("the agent's build settings: %v", settings)
	}
	// Go stamps the commit only where .git is a folder: in a git worktree
	// (.git is a file) there is none, and `mtlsbridge version` says
	// "unknown"; the image's label still names the commit.
	if rev, ok := settings["vcs.revision"]; ok && rev != revision {
		t.Errorf("the agent was built from %s, the label says %s", rev, revision)
	} else if !ok {
		t.Logf("no vcs.revision in the binary (a git worktree?); the label carries %s", revision)
	}
	cni := exec.Command(filepath.Join(dir, ociimage.CNI))
	cni.Env = []string{"CNI_COMMAND=VERSION"}
	if out, err := cni.CombinedOutput(); err != nil || !strings.Contains(string(out), "supportedVersions") {
		t.Errorf("mtlsbridge-cni VERSION: %q (%v)", out, err)
	}

	// Both outputs of make image read back as the same image.
	tarPath := filepath.Join(t.TempDir(), "image.tar")
	must(t, ociimage.WriteTarball(img, "mtlsbridge:test", tarPath))
	fromTar, err := tarball.ImageFromPath(tarPath, nil)
	must(t, err)
	// The tarball is docker's format (its own manifest.json): the same
	// configuration (docker load's image ID) and the same layers.
	if c, err := fromTar.ConfigName(); err != nil || c != mustHash(t, img.ConfigName) {
		t.Errorf("tarball's configuration %v (%v), want %v", c, err, mustHash(t, img.ConfigName))
	}
	tarLayers, err := fromTar.Layers()
	must(t, err)
	for i, l := range tarLayers {
		if d, err := l.DiffID(); err != nil || i >= len(layers) || d != mustHash(t, layers[i].DiffID) {
			t.Errorf("tarball layer %d: %v (%v)", i, d, err)
		}
	}
	layoutDir := filepath.Join(t.TempDir(), "oci")
	must(t, ociimage.WriteLayout(img, "mtlsbridge:test", layoutDir))
	index, err := layout.ImageIndexFromPath(layoutDir)
	must(t, err)
	im, err := index.IndexManifest()
	must(t, err)
	if len(im.Manifests) != 1 || im.Manifests[0].Digest != digest || im.Manifests[0].Annotations["org.opencontainers.image.ref.name"] != "mtlsbridge:test" {
		t.Errorf("layout index %+v, want the image %v named mtlsbridge:test", im.Manifests, digest)
	}
}

func mustHash(t testing.TB, f func() (v1.Hash, error)) v1.Hash {
	t.Helper()
	h, err := f()
	must(t, err)
	return h
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
