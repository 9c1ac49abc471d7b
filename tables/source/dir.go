// SPDX-License-Identifier: Apache-2.0

package source

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strings"
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

// sync brings the tables in line with the folder in one transaction.
func (d *dirSource) sync(health cell.Health) {
	entries, err := os.ReadDir(d.dir)
	if err != nil {
		// Keep what the tables hold: losing the folder must not unenroll pods.
		d.log.Error("Reading manifest folder failed; keeping the objects read before", "dir", d.dir, "error", err)
		health.Degraded("reading manifest folder", err)
		return
	}
	present := map[string]bool{}
	for _, e := range entries {
		if !e.IsDir() && isManifest(e.Name()) {
			present[filePrefix+e.Name()] = true
		}
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

	names := make([]string, 0, len(present))
	for name := range present {
		names = append(names, name)
	}
	sort.Strings(names)
	var set objectSet
	for _, name := range names {
		old, _, _ := srcs.Get(txn, tables.SourceByName(name))
		src := d.readFile(name, old)
		if src != old {
			srcs.Insert(txn, src)
		}
		for _, obj := range src.Decoded {
			set.add(obj)
		}
	}
	d.tables.replaceAll(txn, &set)
	for _, done := range d.initDone {
		done(txn)
	}
	d.initDone = nil
	txn.Commit()
	health.OK(fmt.Sprintf("%d manifest files", len(names)))
}

// readFile returns the sources row for a file: old itself when the content
// did not change, the last good objects with an error when it does not
// parse.
func (d *dirSource) readFile(name string, old *tables.Source) *tables.Source {
	path := filepath.Join(d.dir, strings.TrimPrefix(name, filePrefix))
	content, err := os.ReadFile(path)
	src := &tables.Source{Name: name, Synced: true}
	if old != nil {
		src.Decoded, src.Objects = old.Decoded, old.Objects
	}
	if err != nil {
		src.Error = err.Error()
		d.log.Error("Reading manifest file failed; keeping its objects read before", "file", path, "error", err)
		return src
	}
	sum := sha256.Sum256(content)
	digest := hex.EncodeToString(sum[:])
	if old != nil && old.Digest == digest {
		return old
	}
	src.Digest = digest
	objs, objErrs, err := decodeManifests(content)
	if err != nil {
		src.Error = err.Error()
		d.log.Error("Manifest file does not parse; keeping its objects read before", "file", path, "error", err)
		return src
	}
	src.Decoded, src.Objects = objs, len(objs)
	if len(objErrs) > 0 {
		msgs := make([]string, len(objErrs))
		for i, e := range objErrs {
			msgs[i] = e.Error()
		}
		src.Error = strings.Join(msgs, "; ")
		for _, e := range objErrs {
			d.log.Error("Ignoring manifest object", "file", path, "error", e)
		}
	}
	return src
}

// decodeManifests splits a multi-document YAML file and decodes each object
// (and each item of a v1 List). A syntax error fails the whole file; an
// object that cannot be used is reported in objErrs and skipped.
func decodeManifests(content []byte) (objs []any, objErrs []error, err error) {
	reader := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(content)))
	type document struct {
		number int
		object *unstructured.Unstructured
		err    error // the document is valid YAML but not an object
	}
	var docs []document
	for i := 1; ; i++ {
		doc, err := reader.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, nil, fmt.Errorf("document %d: %w", i, err)
		}
		js, err := yaml.YAMLToJSON(doc)
		if err != nil {
			return nil, nil, fmt.Errorf("document %d: %w", i, err)
		}
		if bytes.Equal(bytes.TrimSpace(js), []byte("null")) {
			continue // an empty document
		}
		u := &unstructured.Unstructured{}
		if err := u.UnmarshalJSON(js); err != nil {
			docs = append(docs, document{number: i, err: err})
			continue
		}
		if u.GroupVersionKind() == listGVK {
			items, err := u.ToList()
			if err != nil {
				return nil, nil, fmt.Errorf("document %d: %w", i, err)
			}
			for j := range items.Items {
				docs = append(docs, document{number: i, object: &items.Items[j]})
			}
			continue
		}
		docs = append(docs, document{number: i, object: u})
	}
	for _, doc := range docs {
		var obj any
		err := doc.err
		if err == nil {
			obj, err = decode(doc.object)
		}
		if err != nil {
			objErrs = append(objErrs, fmt.Errorf("document %d: %w", doc.number, err))
		}
		if obj != nil {
			objs = append(objs, obj)
		}
	}
	return objs, objErrs, nil
}
