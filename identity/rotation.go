// SPDX-License-Identifier: Apache-2.0

package identity

import (
	"bytes"
	"crypto/x509"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"

	"github.com/mtlsbridge/mtlsbridge/internal/atomicfile"
)

// materialFiles hold CA material by file name (CACertFile, ...): a folder,
// or a Secret's data held in memory.
type materialFiles interface {
	// read fails with an error matching fs.ErrNotExist for a missing file.
	read(name string) ([]byte, error)
	write(name string, data []byte, mode os.FileMode) error
	// remove fails with an error matching fs.ErrNotExist for a missing
	// file.
	remove(name string) error
	// String names where the files are, for errors.
	String() string
}

// dirFiles are the files of a folder, each written atomically.
type dirFiles string

func (d dirFiles) read(name string) ([]byte, error) {
	return os.ReadFile(filepath.Join(string(d), name))
}
func (d dirFiles) write(name string, data []byte, mode os.FileMode) error {
	return atomicfile.Write(filepath.Join(string(d), name), data, mode)
}
func (d dirFiles) remove(name string) error { return os.Remove(filepath.Join(string(d), name)) }
func (d dirFiles) String() string           { return string(d) }

// memoryFiles are files in memory: a Secret's data, whose key never goes
// to a disk.
type memoryFiles struct {
	name  string
	files map[string][]byte
}

func (m memoryFiles) read(name string) ([]byte, error) {
	data, ok := m.files[name]
	if !ok {
		return nil, &fs.PathError{Op: "read", Path: m.name + ": " + name, Err: fs.ErrNotExist}
	}
	return data, nil
}

func (m memoryFiles) write(name string, data []byte, _ os.FileMode) error {
	m.files[name] = bytes.Clone(data)
	return nil
}

func (m memoryFiles) remove(name string) error {
	if _, ok := m.files[name]; !ok {
		return &fs.PathError{Op: "remove", Path: m.name + ": " + name, Err: fs.ErrNotExist}
	}
	delete(m.files, name)
	return nil
}

func (m memoryFiles) String() string { return m.name }

// loadMaterial parses the material of files; TrustedRootsFile is optional.
func loadMaterial(files materialFiles) (*Material, error) {
	certPEM, err := files.read(CACertFile)
	if err != nil {
		return nil, err
	}
	keyPEM, err := files.read(CAKeyFile)
	if err != nil {
		return nil, err
	}
	trusted, err := files.read(TrustedRootsFile)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, err
	}
	return ParseMaterial(certPEM, keyPEM, trusted)
}

// writeRoot writes a root and its key. Key first: a folder with a
// certificate but no key is never valid.
func writeRoot(files materialFiles, certFile, keyFile string, certPEM, keyPEM []byte) error {
	if err := files.write(keyFile, keyPEM, 0o600); err != nil {
		return err
	}
	return files.write(certFile, certPEM, 0o644)
}

// The next root of a rotation in a CA folder, between its two steps.
const (
	NextCACertFile = "next-ca-cert.pem"
	NextCAKeyFile  = "next-ca-key.pem"
)

// RotationStep is what RotateDir did.
type RotationStep int

const (
	// RootTrusted: a new root is trusted (it is in the bundle); the
	// current root still signs.
	RootTrusted RotationStep = iota + 1
	// RootSigning: the root trusted in the first step signs; the one
	// before it stays trusted until RetireDir.
	RootSigning
)

// RotateDir advances a root rotation in a CA folder by one step. A new
// root is trusted before it signs, so that no peer is shown a certificate
// it cannot verify yet:
//  1. without a next root, a new one is written as the next root
//     (NextCACertFile) and joins the trusted roots;
//  2. with one, it becomes the signing root, and the current root joins
//     the trusted roots.
//
// Between the steps, every mTLS agent must pick up the bundle. Certificates
// of both roots verify against it until RetireDir. A step that was
// interrupted is completed by running RotateDir again.
func RotateDir(dir, trustDomain string) (RotationStep, error) {
	return rotate(dirFiles(dir), trustDomain)
}

func rotate(files materialFiles, trustDomain string) (RotationStep, error) {
	certPEM, certErr := files.read(NextCACertFile)
	keyPEM, keyErr := files.read(NextCAKeyFile)
	// The next root's key, then its certificate, become the signing ones,
	// then the next files go, key first: each interruption is recognised
	// and completed here.
	finish := func() (RotationStep, error) {
		return RootSigning, errors.Join(ignoreNotExist(files.remove(NextCAKeyFile)), ignoreNotExist(files.remove(NextCACertFile)))
	}
	current, err := loadMaterial(files)
	if err != nil {
		signingKey, readErr := files.read(CAKeyFile)
		if certErr != nil || keyErr != nil || readErr != nil || !bytes.Equal(signingKey, keyPEM) {
			return 0, err
		}
		if err := files.write(CACertFile, certPEM, 0o644); err != nil {
			return 0, err
		}
		return finish()
	}
	if certs, _ := parseCertificates(certPEM); certErr == nil && len(certs) == 1 && certs[0].Equal(current.Root) {
		return finish() // it signs already
	}
	if errors.Is(certErr, fs.ErrNotExist) || errors.Is(keyErr, fs.ErrNotExist) {
		// No next root, or only part of one: a new one.
		if certPEM, keyPEM, err = NewRootMaterial(trustDomain, rootValidity); err != nil {
			return 0, err
		}
		if err := writeRoot(files, NextCACertFile, NextCAKeyFile, certPEM, keyPEM); err != nil {
			return 0, err
		}
	} else if err := errors.Join(certErr, keyErr); err != nil {
		return 0, err
	}
	next, err := ParseMaterial(certPEM, keyPEM, nil)
	if err != nil {
		return 0, fmt.Errorf("next root: %w", err)
	}
	if !slices.ContainsFunc(current.Trusted, next.Root.Equal) {
		return RootTrusted, writeTrusted(files, append(current.Trusted, next.Root))
	}
	// Trusted first: until the next root signs, the current one must be.
	// The next root stays listed, so that a second step interrupted here is
	// still recognised as one.
	others := slices.DeleteFunc(slices.Clone(current.Trusted), func(c *x509.Certificate) bool {
		return c.Equal(next.Root) || c.Equal(current.Root)
	})
	trusted := append([]*x509.Certificate{current.Root}, others...)
	if err := writeTrusted(files, append(trusted, next.Root)); err != nil {
		return 0, err
	}
	if err := writeRoot(files, CACertFile, CAKeyFile, certPEM, keyPEM); err != nil {
		return 0, err
	}
	return finish()
}

func ignoreNotExist(err error) error {
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	return err
}

func writeTrusted(files materialFiles, roots []*x509.Certificate) error {
	return files.write(TrustedRootsFile, encodeCertificates(roots), 0o644)
}

// RetireDir ends a rotation: only the signing root stays trusted. Run it once
// every certificate signed by the older roots has expired.
//
// Possible errors: ErrNothingToRetire when no older root is trusted.
func RetireDir(dir string) error { return retire(dirFiles(dir)) }

func retire(files materialFiles) error {
	if _, err := files.read(NextCACertFile); err == nil {
		return fmt.Errorf("%w: %s holds a next root that is not signing yet", ErrRotationHalfway, files)
	}
	err := files.remove(TrustedRootsFile)
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("%w: %s has no %s", ErrNothingToRetire, files, TrustedRootsFile)
	}
	return err
}

// ErrRotationHalfway: RetireDir would untrust a root about to sign; the
// rotation's second step comes first.
var ErrRotationHalfway = errors.New("rotation half-way: run rotate again first")

// ErrNothingToRetire: RetireDir found no rotation in progress.
var ErrNothingToRetire = errors.New("nothing to retire: no older root is trusted")
