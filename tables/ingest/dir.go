// SPDX-License-Identifier: Apache-2.0

package ingest

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"syscall"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/fsnotify/fsnotify"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"

	"github.com/mtlsbridge/mtlsbridge/tables"
)

// filePrefix starts the sources row of a manifest file.
const filePrefix = "file:"

// dirSource feeds the tables from a folder of YAML manifests and follows
// changes to it. Every change re-reads the files whose content changed and
// makes the tables hold the union of all files' objects.
type dirSource struct {
	dir      string
	maxBytes int64
	log      *slog.Logger
	tables   *writeTables
	settle   time.Duration
	initDone []func(statedb.WriteTxn)
}

func (d *dirSource) run(ctx context.Context, health cell.Health) error {
	watcher, err := fsnotify.NewWatcher()
	if err != nil {
		return fmt.Errorf("watch %s: %w", d.dir, err)
	}
	defer watcher.Close()
	if err := watcher.Add(d.dir); err != nil {
		return fmt.Errorf("watch %s: %w", d.dir, err)
	}

	d.sync(health)
	// Events come in bursts (an editor writes, renames, chmods); settle
	// before re-reading so that one save is one transaction.
	var settled <-chan time.Time
	for {
		select {
		case <-ctx.Done():
			return nil
		case ev, ok := <-watcher.Events:
			if !ok {
				return nil
			}
			if isManifest(ev.Name) && settled == nil {
				settled = time.After(d.settle)
			}
		case err, ok := <-watcher.Errors:
			if !ok {
				return nil
			}
			d.log.Warn("Watching manifest folder failed, rescanning", "dir", d.dir, "error", err)
			settled = time.After(d.settle)
		case <-settled:
			settled = nil
			d.sync(health)
		}
	}
}

func isManifest(name string) bool {
	ext := filepath.Ext(name)
	return (ext == ".yaml" || ext == ".yml") && !strings.HasPrefix(filepath.Base(name), ".")
}

// manifestFile is what reading one file of the folder gave.
type manifestFile struct {
	name    string // sources row name, "file:NAME"
	content []byte
	err     error
}

// sync brings the tables in line with the folder: it reads the files first,
// outside any transaction (a slow or hostile file then blocks no reader of
// the tables), and writes the tables in one transaction.
func (d *dirSource) sync(health cell.Health) {
	files, err := d.readFolder()
	if err != nil {
		// Keep what the tables hold: losing the folder must not unenroll pods.
		d.log.Error("Reading manifest folder failed; keeping the objects read before", "dir", d.dir, "error", err)
		health.Degraded("reading manifest folder", err)
		return
	}
	present := map[string]bool{}
	for _, f := range files {
		present[f.name] = true
	}

	txn := d.tables.DB.WriteTxn(d.tables.all()...)
	defer txn.Abort()
	srcs := d.tables.Sources

	var stale []*tables.Source
	for src := range srcs.Prefix(txn, tables.SourceByName(filePrefix)) {
		if !present[src.Name] {
			stale = append(stale, src)
		}
	}
	for _, src := range stale {
		d.log.Info("Manifest file removed", "file", strings.TrimPrefix(src.Name, filePrefix))
		srcs.Delete(txn, src)
	}

	rows := make([]*tables.Source, len(files))
	for i, f := range files {
		old, _, _ := srcs.Get(txn, tables.SourceByName(f.name))
		rows[i] = d.fileRow(f, old)
	}
	// The union of the files, the first definition of an object winning
	// (files by name, documents in order); each duplicate is reported in
	// the rows of both files.
	var set objectSet
	dups := map[string][]string{}
	for _, row := range rows {
		for i, obj := range row.Decoded {
			if winner, dup := set.add(obj, origin{row.Name, row.Documents[i]}); dup {
				what := describe(obj)
				dups[row.Name] = append(dups[row.Name], fmt.Sprintf("document %d: %s is also defined in %s (document %d), which is used",
					row.Documents[i], what, winner.file, winner.document))
				dups[winner.file] = append(dups[winner.file], fmt.Sprintf("document %d: %s is defined again in %s (document %d), which is ignored",
					winner.document, what, row.Name, row.Documents[i]))
				d.log.Warn("Duplicate manifest object ignored", "object", what, "file", row.Name, "used", winner.file)
			}
		}
	}
	for _, row := range rows {
		if len(dups[row.Name]) > 0 {
			c := *row
			c.Duplicates = strings.Join(dups[row.Name], "; ")
			row = &c
		}
		if old, _, _ := srcs.Get(txn, tables.SourceByName(row.Name)); old == nil || !reflect.DeepEqual(old, row) {
			srcs.Insert(txn, row)
		}
	}
	d.tables.replaceAll(txn, &set)
	for _, done := range d.initDone {
		done(txn)
	}
	d.initDone = nil
	txn.Commit()
	health.OK(fmt.Sprintf("%d manifest files", len(files)))
}

// readFolder reads the manifest files of the folder, sorted by name. Only
// regular files are read, only inside the folder (a symlink leading out is
// refused, one inside, as a ConfigMap volume has, is followed), and only up
// to --manifest-max-bytes: a FIFO, a device or /etc/shadow linked in must
// neither hang the agent, fill its memory nor reach its tables and logs.
func (d *dirSource) readFolder() ([]manifestFile, error) {
	root, err := os.OpenRoot(d.dir)
	if err != nil {
		return nil, err
	}
	defer root.Close()
	entries, err := fs.ReadDir(root.FS(), ".")
	if err != nil {
		return nil, err
	}
	var files []manifestFile
	for _, e := range entries {
		if e.IsDir() || !isManifest(e.Name()) {
			continue
		}
		content, err := readManifest(root, e.Name(), d.maxBytes)
		files = append(files, manifestFile{name: filePrefix + e.Name(), content: content, err: err})
	}
	return files, nil // ReadDir sorts by name
}

// Errors of a manifest file that is not read.
var (
	errNotRegular = errors.New("not a regular file: not read")
	errTooLarge   = errors.New("larger than --manifest-max-bytes: not read")
)

func readManifest(root *os.Root, name string, maxBytes int64) ([]byte, error) {
	// O_NONBLOCK: opening a FIFO must not wait for a writer.
	f, err := root.OpenFile(name, os.O_RDONLY|syscall.O_NONBLOCK|syscall.O_NOCTTY, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	info, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !info.Mode().IsRegular() {
		return nil, fmt.Errorf("%w (%s)", errNotRegular, info.Mode().Type())
	}
	if info.Size() > maxBytes {
		return nil, fmt.Errorf("%w (%d bytes)", errTooLarge, info.Size())
	}
	content, err := io.ReadAll(io.LimitReader(f, maxBytes+1))
	if err == nil && int64(len(content)) > maxBytes {
		err = errTooLarge
	}
	return content, err
}

// fileRow returns the sources row for a file: old itself when the content
// did not change, the last good objects with an error when it cannot be
// read or does not parse.
func (d *dirSource) fileRow(f manifestFile, old *tables.Source) *tables.Source {
	file := strings.TrimPrefix(f.name, filePrefix)
	src := &tables.Source{Name: f.name, Synced: true}
	if old != nil {
		src.Decoded, src.Documents, src.Objects = old.Decoded, old.Documents, old.Objects
	}
	if f.err != nil {
		src.Error = f.err.Error()
		d.log.Error("Manifest file not read; keeping its objects read before", "dir", d.dir, "file", file, "error", f.err)
		return src
	}
	sum := sha256.Sum256(f.content)
	digest := hex.EncodeToString(sum[:])
	if old != nil && old.Digest == digest {
		c := *old
		c.Duplicates = "" // found anew by every sync
		return &c
	}
	src.Digest = digest
	objs, docs, objErrs, err := decodeManifests(f.content)
	if err != nil {
		src.Error = err.Error()
		d.log.Error("Manifest file does not parse; keeping its objects read before", "dir", d.dir, "file", file, "error", err)
		return src
	}
	if len(objErrs) > 0 && old != nil {
		// An object that cannot be used may be a bad edit of one read
		// before: the file's earlier objects it no longer defines stay
		// until it has no bad object, so that a typo never deletes a pod.
		defined := map[string]bool{}
		for _, o := range objs {
			defined[describe(o)] = true
		}
		for i, o := range old.Decoded {
			if !defined[describe(o)] {
				objs, docs = append(objs, o), append(docs, old.Documents[i])
			}
		}
	}
	src.Decoded, src.Documents, src.Objects = objs, docs, len(objs)
	if len(objErrs) > 0 {
		msgs := make([]string, len(objErrs))
		for i, e := range objErrs {
			msgs[i] = e.Error()
		}
		src.Error = strings.Join(msgs, "; ")
		for _, e := range objErrs {
			d.log.Error("Ignoring manifest object", "dir", d.dir, "file", file, "error", e)
		}
	}
	return src
}

// decodeManifests splits a multi-document YAML file and decodes each object
// (and each item of a v1 List), returning the objects with the number of the
// document each came from. A syntax error fails the whole file; an object
// that cannot be used is reported in objErrs and skipped. No error quotes
// the file's content: errors reach logs and the sources table.
func decodeManifests(content []byte) (objs []any, docs []int, objErrs []error, err error) {
	reader := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(content)))
	for i := 1; ; i++ {
		doc, err := reader.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, nil, nil, fmt.Errorf("document %d: %w", i, err)
		}
		js, err := yaml.YAMLToJSON(doc)
		if err != nil {
			return nil, nil, nil, fmt.Errorf("document %d: %w", i, err)
		}
		var object any
		if err := json.Unmarshal(js, &object); err != nil {
			return nil, nil, nil, fmt.Errorf("document %d: not JSON-compatible YAML", i)
		}
		if object == nil {
			continue // an empty document
		}
		u, err := asObject(object)
		if err != nil {
			objErrs = append(objErrs, fmt.Errorf("document %d: %w", i, err))
			continue
		}
		items := []unstructured.Unstructured{*u}
		if u.GroupVersionKind() == listGVK {
			list, err := u.ToList()
			if err != nil {
				return nil, nil, nil, fmt.Errorf("document %d: a List whose items are not objects", i)
			}
			items = list.Items
		}
		for j := range items {
			obj, err := decode(&items[j])
			if err != nil {
				objErrs = append(objErrs, fmt.Errorf("document %d: %w", i, err))
			}
			if obj != nil {
				objs, docs = append(objs, obj), append(docs, i)
			}
		}
	}
	return objs, docs, objErrs, nil
}

// errNotObject: a YAML document that is not a Kubernetes object.
var errNotObject = errors.New("not a Kubernetes object: want a mapping with string apiVersion and kind")

// asObject checks the shape of a Kubernetes object (unstructured's own
// check would quote the document in its error).
func asObject(v any) (*unstructured.Unstructured, error) {
	m, ok := v.(map[string]any)
	if !ok {
		return nil, errNotObject
	}
	if _, ok := m["apiVersion"].(string); !ok {
		return nil, errNotObject
	}
	if _, ok := m["kind"].(string); !ok {
		return nil, errNotObject
	}
	return &unstructured.Unstructured{Object: m}, nil
}
