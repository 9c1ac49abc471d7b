// SPDX-License-Identifier: Apache-2.0

// Package client talks to a running agent through the sockets in its state
// folder: the HTTP API on api.sock and the read-only shell on shell.sock.
// The command line and the CNI plugin use it. It imports nothing of the
// agent, so that the plugin binary stays small.
package client

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"time"
)

// Socket names in the state folder.
const (
	APISocket   = "api.sock"
	ShellSocket = "shell.sock"
)

// SocketPath is the API socket of a state folder.
func SocketPath(stateDir string) string { return filepath.Join(stateDir, APISocket) }

// ShellSocketPath is the shell socket of a state folder.
func ShellSocketPath(stateDir string) string { return filepath.Join(stateDir, ShellSocket) }

// ErrUnreachable is wrapped by every error of a dial that failed: no agent
// serves this state folder (or the caller may not use it).
var ErrUnreachable = errors.New("is `mtlsbridge agent` running with the same --state-dir (and are you root)?")

// dialTimeout bounds how long a caller waits for the agent to accept.
const dialTimeout = 2 * time.Second

// dial connects to a socket, failing fast and clearly when nothing serves it.
func dial(ctx context.Context, sock string) (net.Conn, error) {
	conn, err := (&net.Dialer{Timeout: dialTimeout}).DialContext(ctx, "unix", sock)
	if err != nil {
		return nil, fmt.Errorf("cannot reach the agent at %s: %w (%w)", sock, err, ErrUnreachable)
	}
	return conn, nil
}

// Client is an HTTP client of one agent's API socket.
type Client struct {
	sock string
	http *http.Client
}

// New returns a client of the agent serving stateDir.
func New(stateDir string) *Client {
	sock := SocketPath(stateDir)
	return &Client{sock: sock, http: &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) { return dial(ctx, sock) },
	}}}
}

// Do sends a request to path ("/v1/bypass") and returns the response;
// the caller closes its body.
func (c *Client) Do(ctx context.Context, method, path, contentType string, body io.Reader) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, method, "http://agent"+path, body)
	if err != nil {
		return nil, err
	}
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	return c.http.Do(req)
}

// GetJSON decodes the JSON answer of GET path into v. An answer other than
// 200 OK is an error carrying the status and the start of the body.
func (c *Client) GetJSON(ctx context.Context, path string, v any) error {
	resp, err := c.Do(ctx, http.MethodGet, path, "", nil)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return StatusError(resp)
	}
	if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
		return fmt.Errorf("agent answered with malformed JSON: %w", err)
	}
	return nil
}

// StatusError describes an answer other than the one expected.
func StatusError(resp *http.Response) error {
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	return fmt.Errorf("agent answered %s: %s", resp.Status, strings.TrimSpace(string(body)))
}

// Markers of the shell protocol (that of github.com/cilium/hive/shell, so
// that its interactive client works too): each command's output ends with
// a line ending in EndMarker, or in ErrorMarker after its error.
const (
	EndMarker    = "<<end>>"
	ErrorMarker  = "<<error>>"
	stdoutMarker = "[stdout]"
	stderrMarker = "[stderr]"
)

// CheckShell fails, as Shell would, when no agent serves the shell.
func CheckShell(ctx context.Context, stateDir string) error {
	conn, err := dial(ctx, ShellSocketPath(stateDir))
	if err != nil {
		return err
	}
	return conn.Close()
}

// Shell runs one command line on the agent's shell and copies its output
// to w. A command that fails returns its error.
func Shell(ctx context.Context, stateDir string, w io.Writer, line string) error {
	conn, err := dial(ctx, ShellSocketPath(stateDir))
	if err != nil {
		return err
	}
	defer conn.Close()
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	if _, err := fmt.Fprintf(conn, "%s\nexit\n", line); err != nil {
		return err
	}
	r := bufio.NewReader(conn)
	for {
		text, err := r.ReadString('\n')
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return fmt.Errorf("shell: connection closed before the command ended: %w", err)
		}
		text = strings.TrimSuffix(text, "\n")
		if text == stdoutMarker || text == stderrMarker {
			continue
		}
		if out, ok := strings.CutSuffix(text, EndMarker); ok {
			if out != "" {
				_, err = fmt.Fprintln(w, out)
			}
			return err
		}
		if msg, ok := strings.CutSuffix(text, ErrorMarker); ok {
			return errors.New(msg)
		}
		if _, err := fmt.Fprintln(w, text); err != nil {
			return err
		}
	}
}
