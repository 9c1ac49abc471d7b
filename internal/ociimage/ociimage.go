// SPDX-License-Identifier: Apache-2.0

// Package ociimage builds mtlsbridge's container image without a container
// engine: the static binaries on a base the build makes itself (a passwd
// file and /tmp, nothing else), assembled with go-containerregistry.
//
// The image is reproducible: the same sources and inputs give the same
// bytes, hence the same digest. Every timestamp is Config.Created
// (SOURCE_DATE_EPOCH, the commit's time), tar entries are sorted and owned
// by 0:0 with fixed modes, gzip headers carry no name or time, and the
// binaries come from a reproducible go build (BuildBinaries).
package ociimage

import (
	"archive/tar"
	"bytes"
	"fmt"
	"io"
	"os"
	"path"
	"sort"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// BinDir is where the binaries go in the image.
const BinDir = "/usr/local/bin"

// Config describes the image.
type Config struct {
	// Binaries maps a name in BinDir to the file on disk to copy there.
	Binaries map[string]string
	// Entrypoint is the name in BinDir that the image runs.
	Entrypoint string
	// User is the image's user ("UID:GID").
	User string
	// Revision is the source's commit, Version its human name (e.g. git
	// describe), Source its repository URL.
	Revision, Version, Source string
	// Created is the time of every file, history entry and the image
	// itself: the commit's time, so that a rebuild is byte for byte equal.
	Created time.Time
	// OS and Architecture of the binaries.
	OS, Architecture string
}

// file is one entry of a layer.
type file struct {
	name string // absolute, without the leading slash in the tar
	mode int64
	dir  bool
	data []byte
}

// Build assembles the image: a base layer (passwd, group, /tmp), then one
// layer with the binaries. OCI media types throughout.
func Build(cfg Config) (v1.Image, error) {
	if _, ok := cfg.Binaries[cfg.Entrypoint]; !ok {
		return nil, fmt.Errorf("entrypoint %q is not among the binaries", cfg.Entrypoint)
	}
	created := cfg.Created.UTC()

	base, err := layer(baseFiles(), created)
	if err != nil {
		return nil, fmt.Errorf("base layer: %w", err)
	}
	var bins []file
	for _, dir := range []string{"/usr", "/usr/local", BinDir} {
		bins = append(bins, file{name: dir, mode: 0o755, dir: true})
	}
	names := make([]string, 0, len(cfg.Binaries))
	for name := range cfg.Binaries {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		data, err := os.ReadFile(cfg.Binaries[name])
		if err != nil {
			return nil, err
		}
		bins = append(bins, file{name: path.Join(BinDir, name), mode: 0o755, data: data})
	}
	binLayer, err := layer(bins, created)
	if err != nil {
		return nil, fmt.Errorf("binaries layer: %w", err)
	}

	img := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
	img, err = mutate.Append(img,
		mutate.Addendum{Layer: base, MediaType: types.OCILayer, History: v1.History{
			Created: v1.Time{Time: created}, CreatedBy: "mtlsbridge base: /etc/passwd, /etc/group, /tmp", Comment: "built by hack/image"}},
		mutate.Addendum{Layer: binLayer, MediaType: types.OCILayer, History: v1.History{
			Created: v1.Time{Time: created}, CreatedBy: "COPY " + strings.Join(names, " ") + " " + BinDir + "/", Comment: "built by hack/image"}},
	)
	if err != nil {
		return nil, err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = cfg.OS, cfg.Architecture
	cf.Created = v1.Time{Time: created}
	cf.Config = v1.Config{
		Entrypoint: []string{path.Join(BinDir, cfg.Entrypoint)},
		User:       cfg.User,
		WorkingDir: "/",
		Env:        []string{"PATH=" + BinDir + ":/usr/bin:/bin"},
		Labels:     Labels(cfg),
	}
	return mutate.ConfigFile(img, cf)
}

// Labels are the OCI annotations of the image, as config labels.
func Labels(cfg Config) map[string]string {
	return map[string]string{
		"org.opencontainers.image.title":       "mtlsbridge",
		"org.opencontainers.image.description": "Node agent for Cilium mTLS through an mTLS agent (CFP-32759), its CNI plugin and reference mTLS agent",
		"org.opencontainers.image.licenses":    "Apache-2.0",
		"org.opencontainers.image.revision":    cfg.Revision,
		"org.opencontainers.image.version":     cfg.Version,
		"org.opencontainers.image.source":      cfg.Source,
		"org.opencontainers.image.created":     cfg.Created.UTC().Format(time.RFC3339),
	}
}

// baseFiles is the whole base: enough for a root process and for tools
// that look up user names; no shell, no libraries, no CA certificates (the
// agent only trusts the cluster's own CA and its CA material).
func baseFiles() []file {
	return []file{
		{name: "/etc", mode: 0o755, dir: true},
		{name: "/etc/passwd", mode: 0o644, data: []byte("root:x:0:0:root:/root:/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\n")},
		{name: "/etc/group", mode: 0o644, data: []byte("root:x:0:\nnobody:x:65534:\n")},
		{name: "/root", mode: 0o700, dir: true},
		{name: "/tmp", mode: 0o1777, dir: true},
	}
}

// layer writes files as a gzip-compressed tar layer with every time set to
// created and entries in name order.
func layer(files []file, created time.Time) (v1.Layer, error) {
	sort.Slice(files, func(i, j int) bool { return files[i].name < files[j].name })
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, f := range files {
		h := &tar.Header{
			Name:    strings.TrimPrefix(f.name, "/"),
			Mode:    f.mode,
			ModTime: created,
			Format:  tar.FormatPAX,
		}
		if f.dir {
			h.Typeflag = tar.TypeDir
			h.Name += "/"
		} else {
			h.Typeflag = tar.TypeReg
			h.Size = int64(len(f.data))
		}
		// Owners 0:0 without names; no access or change times (PAX would
		// record them only if set).
		if err := tw.WriteHeader(h); err != nil {
			return nil, err
		}
		if _, err := tw.Write(f.data); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	data := buf.Bytes()
	return tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(data)), nil
	}, tarball.WithMediaType(types.OCILayer))
}
