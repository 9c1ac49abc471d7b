// SPDX-License-Identifier: Apache-2.0

package api

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"slices"
	"strings"
	"sync"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/hive/script"

	"github.com/mtlsbridge/mtlsbridge/api/client"
	"github.com/mtlsbridge/mtlsbridge/statedir"
)

// ReadOnlyCommands are the script commands the shell offers: those that
// only read the agent's state. Everything else a hive registers (exec,
// cat, db/insert, db/delete, writing a table to a file with --out, ...)
// would let whoever reaches the socket change the node's mTLS or act as
// the agent's user; a command joins this list only once it is known to
// read nothing but the agent's tables and the kernel's state.
var ReadOnlyCommands = []string{
	"help",
	"health",
	ShowCommand,
	"db", "db/show", "db/get", "db/prefix", "db/list", "db/lowerbound", "db/watch", "db/initialized",
	"redirect/map", "redirect/attached",
}

// ErrWritingFlag: a read-only command was asked to write a file.
var ErrWritingFlag = errors.New("the agent's shell writes no files: --out is refused")

type shellParams struct {
	cell.In

	Dir    statedir.Dir
	Log    *slog.Logger
	Jobs   job.Registry
	Health cell.Health
	Cmds   hive.ScriptCmds
}

func registerShell(p shellParams) {
	engine := &script.Engine{Cmds: readOnly(p.Cmds.Map())}
	sock := p.Dir.Path(client.ShellSocket)
	jobs := p.Jobs.NewGroup(p.Health)
	jobs.Add(job.OneShot("shell", func(ctx context.Context, health cell.Health) error {
		l, err := statedir.ListenUnix(sock)
		if err != nil {
			return fmt.Errorf("listen on %s: %w", sock, err)
		}
		defer statedir.CloseUnix(l, sock)
		stop := context.AfterFunc(ctx, func() { l.Close() })
		defer stop()
		health.OK("serving on " + sock)
		var conns sync.WaitGroup
		defer conns.Wait()
		for {
			conn, err := l.Accept()
			if err != nil {
				if ctx.Err() != nil {
					return nil
				}
				return fmt.Errorf("shell accept: %w", err)
			}
			conns.Go(func() { serveShell(ctx, p.Log, engine, conn) })
		}
	}))
}

// readOnly keeps the commands of ReadOnlyCommands that the hive has, each
// refusing a flag that would write a file.
func readOnly(all map[string]script.Cmd) map[string]script.Cmd {
	out := map[string]script.Cmd{}
	for _, name := range ReadOnlyCommands {
		if cmd, ok := all[name]; ok {
			out[name] = noFileOutput{cmd}
		} else if def, ok := script.DefaultCmds()[name]; ok {
			out[name] = noFileOutput{def}
		}
	}
	return out
}

// noFileOutput refuses the --out flag of statedb's commands.
type noFileOutput struct{ script.Cmd }

func (c noFileOutput) Run(s *script.State, args ...string) (script.WaitFunc, error) {
	if f := s.Flags.Lookup("out"); f != nil && f.Value.String() != "" {
		return nil, ErrWritingFlag
	}
	return c.Cmd.Run(s, args...)
}

// serveShell runs one client's command lines, speaking the protocol of
// github.com/cilium/hive/shell: each output ends with client.EndMarker, or
// with the error and client.ErrorMarker.
func serveShell(ctx context.Context, log *slog.Logger, engine *script.Engine, conn net.Conn) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	defer func() {
		if r := recover(); r != nil {
			log.Error("Panic in a shell command", "error", r)
			fmt.Fprintf(conn, "panic: %v%s\n", r, client.ErrorMarker)
		}
	}()
	// Relative paths would be resolved here; no command that remains
	// writes, and the state folder is not the shell's to show.
	s, err := script.NewState(ctx, "/", nil)
	if err != nil {
		log.Error("Shell state", "error", err)
		return
	}
	out := &cancelOnError{w: conn, cancel: cancel}
	r := bufio.NewReader(io.LimitReader(conn, 1<<20))
	for {
		line, err := r.ReadString('\n')
		if err != nil {
			return
		}
		line = strings.TrimSpace(line)
		switch line {
		case "exit", "quit", "stop":
			return
		}
		if err := engine.ExecuteLine(s, line, out); err != nil {
			fmt.Fprintf(out, "%s%s\n", err, client.ErrorMarker)
		} else {
			fmt.Fprintln(out, client.EndMarker)
		}
	}
}

// cancelOnError stops a running command (db/watch) once the client is gone.
type cancelOnError struct {
	w      io.Writer
	cancel func()
}

func (c *cancelOnError) Write(b []byte) (int, error) {
	n, err := c.w.Write(b)
	if err != nil {
		c.cancel()
	}
	return n, err
}

// ShellCommands lists the commands the shell offers in this hive.
func ShellCommands(all map[string]script.Cmd) []string {
	return slices.Sorted(maps.Keys(readOnly(all)))
}
