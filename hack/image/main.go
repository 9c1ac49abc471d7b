// SPDX-License-Identifier: Apache-2.0

// Command image builds mtlsbridge's container image without a container
// engine (make image): the static binaries of this tree on a base it makes
// itself, written as a tarball for `docker load` / `ctr image import` and as
// an OCI image layout. The same commit gives the same digest: every time in
// the image is SOURCE_DATE_EPOCH (make passes the commit's time).
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"time"

	"github.com/mtlsbridge/mtlsbridge/internal/ociimage"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "image:", err)
		os.Exit(1)
	}
}

func run() error {
	tarPath := flag.String("tarball", "bin/image.tar", "Image tarball to write (docker load, ctr image import)")
	layoutDir := flag.String("oci-layout", "bin/image-oci", "OCI image layout folder to write (empty: none)")
	ref := flag.String("tag", "mtlsbridge:dev", "Name and tag the image carries in the tarball and layout")
	revision := flag.String("revision", "", "Commit of the sources (org.opencontainers.image.revision)")
	version := flag.String("version", "", "Version of the sources (org.opencontainers.image.version)")
	source := flag.String("source", "https://github.com/mtlsbridge/mtlsbridge", "Repository (org.opencontainers.image.source)")
	goarch := flag.String("goarch", runtime.GOARCH, "Architecture of the binaries and the image")
	flag.Parse()

	// SOURCE_DATE_EPOCH (reproducible-builds.org): the one time in the image.
	epoch := os.Getenv("SOURCE_DATE_EPOCH")
	if epoch == "" {
		return fmt.Errorf("SOURCE_DATE_EPOCH is not set (make image sets it to the commit's time)")
	}
	secs, err := strconv.ParseInt(epoch, 10, 64)
	if err != nil {
		return fmt.Errorf("SOURCE_DATE_EPOCH=%q: %w", epoch, err)
	}
	if *revision == "" {
		return fmt.Errorf("--revision is empty (make image passes the commit)")
	}
	root, err := os.Getwd()
	if err != nil {
		return err
	}
	tmp, err := os.MkdirTemp("", "mtlsbridge-image-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)

	goBin := filepath.Join(runtime.GOROOT(), "bin", "go")
	bins, missing, err := ociimage.BuildBinaries(goBin, root, tmp, "linux", *goarch, true)
	if err != nil {
		return err
	}
	for _, m := range missing {
		// The hook for the reference mTLS agent: built into the image as
		// soon as its package is in the tree.
		fmt.Fprintf(os.Stderr, "image: ./cmd/%s is not in this tree; the image has no %s\n", m, m)
	}
	img, err := ociimage.Build(ociimage.Config{
		Binaries:     bins,
		Entrypoint:   ociimage.Agent,
		User:         "0:0",
		Revision:     *revision,
		Version:      *version,
		Source:       *source,
		Created:      time.Unix(secs, 0),
		OS:           "linux",
		Architecture: *goarch,
	})
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(*tarPath), 0o755); err != nil {
		return err
	}
	if err := ociimage.WriteTarball(img, *ref, *tarPath); err != nil {
		return err
	}
	if *layoutDir != "" {
		if err := ociimage.WriteLayout(img, *ref, *layoutDir); err != nil {
			return err
		}
	}
	desc, err := ociimage.Describe(img)
	if err != nil {
		return err
	}
	fmt.Printf("%s %s -> %s %s\n", *ref, desc, *tarPath, *layoutDir)
	return nil
}
