// SPDX-License-Identifier: Apache-2.0

package ociimage

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// The image's binaries, each built from ./cmd/NAME.
const (
	Agent = "mtlsbridge"
	CNI   = "mtlsbridge-cni"
	// Proxy, the reference mTLS agent, is included when ./cmd/mtlsbridge-proxy
	// exists in the tree being built (it is written apart from the agent).
	Proxy = "mtlsbridge-proxy"
)

// BuildBinaries builds the image's static binaries from the module at root
// into outDir, reproducibly: no cgo, -trimpath (no build folder in the
// binary), version control stamping as given (the commit and its time, and
// whether the tree had changes: `mtlsbridge version` reports them), and no
// inherited GOFLAGS. It returns the binaries by name and the optional
// commands that are missing.
func BuildBinaries(goBin, root, outDir, goos, goarch string, buildVCS bool) (map[string]string, []string, error) {
	cmds := []string{Agent, CNI}
	var missing []string
	for _, c := range []string{Proxy} {
		if _, err := os.Stat(filepath.Join(root, "cmd", c)); err == nil {
			cmds = append(cmds, c)
		} else if errors.Is(err, os.ErrNotExist) {
			missing = append(missing, c)
		} else {
			return nil, nil, err
		}
	}
	bins := map[string]string{}
	for _, c := range cmds {
		out := filepath.Join(outDir, c)
		cmd := exec.Command(goBin, "build", "-trimpath", fmt.Sprintf("-buildvcs=%t", buildVCS),
			"-ldflags=-s -w", "-o", out, "./cmd/"+c)
		cmd.Dir = root
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS="+goos, "GOARCH="+goarch, "GOFLAGS=", "GOWORK=off")
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		if err := cmd.Run(); err != nil {
			return nil, nil, fmt.Errorf("go build ./cmd/%s: %w\n%s", c, err, stderr.Bytes())
		}
		bins[c] = out
	}
	return bins, missing, nil
}

// WriteTarball writes the image as a tarball that `docker load` and `ctr
// image import` read, tagged ref.
func WriteTarball(img v1.Image, ref, path string) error {
	tag, err := name.NewTag(ref)
	if err != nil {
		return err
	}
	return tarball.WriteToFile(path, tag, img)
}

// WriteLayout writes the image as an OCI image layout folder (replacing
// what was there), its index naming it ref (skopeo, crane, podman and
// buildah read it).
func WriteLayout(img v1.Image, ref, dir string) error {
	if err := os.RemoveAll(dir); err != nil {
		return err
	}
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		return err
	}
	return p.AppendImage(img, layout.WithAnnotations(map[string]string{
		"org.opencontainers.image.ref.name": ref,
	}))
}

// Describe is a one-line summary of an image: its digest and layers.
func Describe(img v1.Image) (string, error) {
	digest, err := img.Digest()
	if err != nil {
		return "", err
	}
	layers, err := img.Layers()
	if err != nil {
		return "", err
	}
	var sizes []string
	for _, l := range layers {
		size, err := l.Size()
		if err != nil {
			return "", err
		}
		sizes = append(sizes, fmt.Sprintf("%d", size))
	}
	return fmt.Sprintf("%s (%d layers, compressed bytes %s)", digest, len(layers), strings.Join(sizes, "+")), nil
}
