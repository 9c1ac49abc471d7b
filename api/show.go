// SPDX-License-Identifier: Apache-2.0

package api

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/script"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"
	"sigs.k8s.io/yaml"

	"github.com/mtlsbridge/mtlsbridge/tables"
)

// ShowCommand is the shell command behind `mtlsbridge db show`.
const ShowCommand = "show"

// ErrUnknownTable: db show of a table the agent does not have.
var ErrUnknownTable = errors.New("unknown table")

// showFilter selects the rows of a table by their scope (tables.Scoped).
type showFilter struct{ namespace, pod, node string }

func (f showFilter) empty() bool { return f == showFilter{} }

func (f showFilter) matches(obj any) bool {
	if f.empty() {
		return true
	}
	s, ok := obj.(tables.Scoped)
	if !ok {
		return false
	}
	sc := s.Scope()
	return (f.namespace == "" || sc.Namespace == f.namespace) &&
		(f.pod == "" || sc.Pod == f.pod || sc.Pod == sc.Namespace+"/"+f.pod) &&
		(f.node == "" || sc.Node == f.node)
}

// showCmd prints a table's rows, filtered, as a table, JSON or YAML; with
// no table, or an unknown one, it lists the tables; with --watch it goes on
// printing the rows that change.
func showCmd(db *statedb.DB) hive.ScriptCmdOut {
	return hive.NewScriptCmd(ShowCommand, script.Command(
		script.CmdUsage{
			Summary: "Show a table's rows, filtered (no table: list the tables)",
			Args:    "[table]",
			Flags: func(fs *pflag.FlagSet) {
				fs.StringP("output", "o", "table", "table, json or yaml")
				fs.String("namespace", "", "only rows of this namespace")
				fs.String("pod", "", "only rows of this pod (NAME with --namespace, or NAMESPACE/NAME)")
				fs.String("node", "", "only rows of this node")
				fs.BoolP("watch", "w", false, "go on printing the rows that change")
			},
		},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			output, _ := s.Flags.GetString("output")
			var f showFilter
			f.namespace, _ = s.Flags.GetString("namespace")
			f.pod, _ = s.Flags.GetString("pod")
			f.node, _ = s.Flags.GetString("node")
			watch, _ := s.Flags.GetBool("watch")
			if output != "table" && output != "json" && output != "yaml" {
				return nil, fmt.Errorf("--output=%q: want table, json or yaml", output)
			}
			w := s.LogWriter()
			if len(args) == 0 {
				return nil, listTables(w, db)
			}
			tbl := db.GetTable(db.ReadTxn(), args[0])
			if tbl == nil {
				var names []string
				for _, t := range db.GetTables(db.ReadTxn()) {
					names = append(names, t.Name())
				}
				slices.Sort(names)
				return nil, fmt.Errorf("%w %q (the tables: %s)", ErrUnknownTable, args[0], strings.Join(names, ", "))
			}
			table := statedb.AnyTable{Meta: tbl}
			if !watch {
				rows := matching(table, db.ReadTxn(), f)
				return nil, printRows(w, table, rows, output)
			}
			// --watch: the rows that change, as they change, until the
			// caller goes.
			seen := map[string]statedb.Revision{}
			for first := true; ; first = false {
				txn := db.ReadTxn()
				objs, changed := table.AllWatch(txn)
				var rows []any
				now := map[string]statedb.Revision{}
				for obj, rev := range objs {
					if !f.matches(obj) {
						continue
					}
					key := primaryKey(table, obj)
					now[key] = rev
					if seen[key] != rev {
						rows = append(rows, obj)
					}
				}
				for key := range seen {
					if _, ok := now[key]; !ok {
						fmt.Fprintf(w, "(deleted) %s\n", key)
					}
				}
				seen = now
				if len(rows) > 0 || first {
					if !first {
						fmt.Fprintf(w, "--- %s\n", time.Now().UTC().Format(time.RFC3339))
					}
					if err := printRows(w, table, rows, output); err != nil {
						return nil, err
					}
				}
				if err := s.FlushLog(); err != nil {
					return nil, err
				}
				select {
				case <-s.Context().Done():
					return nil, nil
				case <-changed:
				}
			}
		}))
}

func matching(t statedb.AnyTable, txn statedb.ReadTxn, f showFilter) []any {
	var rows []any
	for obj := range t.All(txn) {
		if f.matches(obj) {
			rows = append(rows, obj)
		}
	}
	return rows
}

func primaryKey(t statedb.AnyTable, obj any) string {
	if row, ok := obj.(interface{ TableRow() []string }); ok {
		if r := row.TableRow(); len(r) > 0 {
			return r[0]
		}
	}
	b, _ := json.Marshal(obj)
	return string(b)
}

// printRows writes rows as a table (TableHeader/TableRow), a JSON array, or
// YAML.
func printRows(w io.Writer, t statedb.AnyTable, rows []any, output string) error {
	switch output {
	case "json", "yaml":
		if rows == nil {
			rows = []any{}
		}
		b, err := json.MarshalIndent(rows, "", "  ")
		if err != nil {
			return err
		}
		if output == "yaml" {
			if b, err = yaml.JSONToYAML(b); err != nil {
				return err
			}
			_, err = w.Write(b)
			return err
		}
		_, err = fmt.Fprintf(w, "%s\n", b)
		return err
	}
	header := t.TableHeader()
	if header == nil {
		return fmt.Errorf("table %q has no table form: use -o json", t.Meta.Name())
	}
	tw := tabwriter.NewWriter(w, 5, 0, 3, ' ', 0)
	fmt.Fprintln(tw, strings.Join(header, "\t"))
	for _, obj := range rows {
		fmt.Fprintln(tw, strings.Join(t.TableRow(obj), "\t"))
	}
	return tw.Flush()
}

// listTables writes the tables, with how many rows each holds.
func listTables(w io.Writer, db *statedb.DB) error {
	txn := db.ReadTxn()
	tbls := db.GetTables(txn)
	slices.SortFunc(tbls, func(a, b statedb.TableMeta) int { return cmp.Compare(a.Name(), b.Name()) })
	tw := tabwriter.NewWriter(w, 5, 0, 3, ' ', 0)
	fmt.Fprintln(tw, "Table\tRows")
	for _, t := range tbls {
		fmt.Fprintf(tw, "%s\t%d\n", t.Name(), t.NumObjects(txn))
	}
	return tw.Flush()
}
