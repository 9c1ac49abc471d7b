// SPDX-License-Identifier: Apache-2.0

// Package plugin is the chained CNI plugin mtlsbridge-cni: placed after
// Cilium in the node's conflist, it lets a pod start only when the node
// agent says the pod is not enrolled, or that its redirection is in place.
// It imports nothing of the agent, so that the binary stays small.
package plugin

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	types100 "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/mtlsbridge/mtlsbridge/api/client"
)

// Defaults of the plugin's configuration.
const (
	DefaultStateDir    = "/var/run/mtlsbridge"
	DefaultWaitTimeout = 30 * time.Second
)

// NetConf is the plugin's entry in the conflist.
type NetConf struct {
	types.PluginConf
	// StateDir holds the agent's api.sock.
	StateDir string `json:"stateDir,omitempty"`
	// FailPolicy is FailClosed (default) or FailOpen.
	FailPolicy string `json:"failPolicy,omitempty"`
	// ExcludedNamespaces start without asking the agent.
	ExcludedNamespaces []string `json:"excludedNamespaces,omitempty"`
	// WaitTimeout bounds how long ADD waits for the redirection (Go
	// duration, default 30s).
	WaitTimeout string `json:"waitTimeout,omitempty"`
}

// Entry is the conflist entry the agent installs.
func Entry(stateDir, failPolicy string, excluded []string, wait time.Duration) map[string]any {
	return map[string]any{
		"type":               PluginType,
		"stateDir":           stateDir,
		"failPolicy":         failPolicy,
		"excludedNamespaces": excluded,
		"waitTimeout":        wait.String(),
	}
}

// k8sArgs are the CNI_ARGS the kubelet passes; field names are the keys.
type k8sArgs struct {
	types.CommonArgs
	K8S_POD_NAMESPACE          types.UnmarshallableString
	K8S_POD_NAME               types.UnmarshallableString
	K8S_POD_INFRA_CONTAINER_ID types.UnmarshallableString
	K8S_POD_UID                types.UnmarshallableString
}

// call is one ADD or CHECK, parsed.
type call struct {
	conf       NetConf
	prevResult json.RawMessage
	namespace  string
	name       string
	wait       time.Duration
	req        Request
}

func parse(args *skel.CmdArgs) (*call, error) {
	c := &call{}
	if err := json.Unmarshal(args.StdinData, &c.conf); err != nil {
		return nil, types.NewError(types.ErrDecodingFailure, "cannot parse the network configuration", err.Error())
	}
	var raw struct {
		PrevResult json.RawMessage `json:"prevResult"`
	}
	json.Unmarshal(args.StdinData, &raw) // parsed above already
	c.prevResult = raw.PrevResult
	if len(c.prevResult) == 0 || string(c.prevResult) == "null" {
		return nil, types.NewError(types.ErrInvalidNetworkConfig, "no prevResult",
			PluginType+" is a chained plugin: it must come after the interface plugin (Cilium) in a conflist")
	}
	switch c.conf.FailPolicy {
	case "":
		c.conf.FailPolicy = FailClosed
	case FailClosed, FailOpen:
	default:
		return nil, types.NewError(types.ErrInvalidNetworkConfig, "invalid failPolicy",
			fmt.Sprintf("%q: want %q or %q", c.conf.FailPolicy, FailClosed, FailOpen))
	}
	if c.conf.StateDir == "" {
		c.conf.StateDir = DefaultStateDir
	}
	c.wait = DefaultWaitTimeout
	if c.conf.WaitTimeout != "" {
		d, err := time.ParseDuration(c.conf.WaitTimeout)
		if err != nil || d < 0 {
			return nil, types.NewError(types.ErrInvalidNetworkConfig, "invalid waitTimeout", fmt.Sprintf("%q: want a duration such as 30s", c.conf.WaitTimeout))
		}
		c.wait = d
	}

	var ka k8sArgs
	if err := types.LoadArgs(args.Args, &ka); err != nil {
		return nil, types.NewError(types.ErrInvalidEnvironmentVariables, "cannot parse CNI_ARGS", err.Error())
	}
	c.namespace, c.name = string(ka.K8S_POD_NAMESPACE), string(ka.K8S_POD_NAME)
	if c.namespace == "" || c.name == "" {
		return nil, types.NewError(types.ErrInvalidEnvironmentVariables, "no pod identity",
			"CNI_ARGS must carry K8S_POD_NAMESPACE and K8S_POD_NAME (set by the kubelet)")
	}

	if err := version.ParsePrevResult(&c.conf.PluginConf); err != nil {
		return nil, types.NewError(types.ErrDecodingFailure, "cannot parse prevResult", err.Error())
	}
	res, err := types100.NewResultFromResult(c.conf.PrevResult)
	if err != nil {
		return nil, types.NewError(types.ErrDecodingFailure, "cannot convert prevResult", err.Error())
	}
	c.req = Request{ContainerID: args.ContainerID, PodUID: string(ka.K8S_POD_UID), Netns: args.Netns, IfName: args.IfName}
	for _, ipc := range res.IPs {
		if addr, ok := netip.AddrFromSlice(ipc.Address.IP); ok {
			c.req.IPs = append(c.req.IPs, addr.Unmap())
		}
	}
	return c, nil
}

// Add implements CNI ADD: the prevResult goes out unchanged once the pod
// may start.
func Add(args *skel.CmdArgs) error {
	c, err := parse(args)
	if err != nil {
		return err
	}
	if err := c.admit(os.Stderr, true); err != nil {
		return err
	}
	return c.printPrevResult(os.Stdout)
}

// Check implements CNI CHECK: the same question as ADD, without waiting.
func Check(args *skel.CmdArgs) error {
	c, err := parse(args)
	if err != nil {
		return err
	}
	return c.admit(os.Stderr, false)
}

// Del implements CNI DEL. It never fails: the agent is told when it can be
// reached, and nothing is printed.
func Del(stdin []byte, getenv func(string) string) {
	var ka k8sArgs
	_ = types.LoadArgs(getenv("CNI_ARGS"), &ka)
	var conf NetConf
	_ = json.Unmarshal(stdin, &conf)
	id := getenv("CNI_CONTAINERID")
	if id == "" {
		return
	}
	if conf.StateDir == "" {
		conf.StateDir = DefaultStateDir
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if resp, err := client.New(conf.StateDir).Do(ctx, http.MethodDelete, ContainerPathPrefix+url.PathEscape(id), "", nil); err == nil {
		resp.Body.Close()
	}
}

// Noop implements the CNI verbs the plugin has nothing to do for (GC,
// STATUS).
func Noop(*skel.CmdArgs) error { return nil }

func (c *call) printPrevResult(w io.Writer) error {
	var buf bytes.Buffer
	if err := json.Indent(&buf, c.prevResult, "", "    "); err != nil {
		return types.NewError(types.ErrIOFailure, "cannot print prevResult", err.Error())
	}
	buf.WriteByte('\n')
	_, err := w.Write(buf.Bytes())
	return err
}

// errUnreachable marks failures to talk to the agent at all.
var errUnreachable = errors.New("agent unreachable")

// admit decides whether the pod may start.
func (c *call) admit(stderr io.Writer, wait bool) error {
	pod := c.namespace + "/" + c.name
	if slices.Contains(c.conf.ExcludedNamespaces, c.namespace) {
		return nil
	}
	deadline := time.Now()
	if wait {
		deadline = deadline.Add(c.wait)
	}
	var last Answer
	for {
		remaining := max(0, time.Until(deadline))
		ans, err := c.ask(min(remaining, MaxWait))
		if errors.Is(err, errUnreachable) {
			if c.conf.FailPolicy == FailOpen {
				fmt.Fprintf(stderr, "%s: WARNING: FAIL-OPEN: pod %s starts WITHOUT mTLS enforcement: %v\n", PluginType, pod, err)
				return nil
			}
			return types.NewError(types.ErrTryAgainLater, "mtlsbridge agent unreachable: pod start refused (fail closed)",
				fmt.Sprintf("pod %s: %v; the kubelet retries; failPolicy %q", pod, err, c.conf.FailPolicy))
		}
		if err != nil {
			return types.NewError(types.ErrInternal, "mtlsbridge agent error", fmt.Sprintf("pod %s: %v", pod, err))
		}
		last = ans
		if ans.Final() {
			return nil
		}
		if time.Until(deadline) <= 0 {
			break
		}
		if !ans.Known {
			// The agent has not seen the pod yet; its long poll returned
			// at once. Ask again shortly.
			time.Sleep(min(200*time.Millisecond, max(0, time.Until(deadline))))
		}
	}
	if !last.Known {
		why := "not in the agent's pods table"
		if last.Detail != "" {
			why = last.Detail
		}
		return types.NewError(types.ErrTryAgainLater, "pod not known to the mtlsbridge agent yet",
			fmt.Sprintf("pod %s: %s after %s; the kubelet retries", pod, why, c.wait))
	}
	return types.NewError(types.ErrTryAgainLater, "mTLS redirection of the pod is not in place",
		fmt.Sprintf("pod %s is enrolled (%s) but its redirect is %s after %s: %s; the kubelet retries",
			pod, last.Reason, last.Redirect, c.wait, last.Detail))
}

// ask posts the request once, holding for at most wait.
func (c *call) ask(wait time.Duration) (Answer, error) {
	body, err := json.Marshal(c.req)
	if err != nil {
		return Answer{}, err
	}
	path := PodPathPrefix + url.PathEscape(c.namespace) + "/" + url.PathEscape(c.name) + "?wait=" + wait.String()
	ctx, cancel := context.WithTimeout(context.Background(), wait+5*time.Second)
	defer cancel()
	resp, err := client.New(c.conf.StateDir).Do(ctx, http.MethodPost, path, "application/json", bytes.NewReader(body))
	if err != nil {
		return Answer{}, fmt.Errorf("%w: %v", errUnreachable, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	switch {
	case resp.StatusCode == http.StatusNotFound || resp.StatusCode >= 500:
		// An agent without the route (older version) or failing: the same
		// as none at all.
		return Answer{}, fmt.Errorf("%w: %s: %s", errUnreachable, resp.Status, strings.TrimSpace(string(b)))
	case resp.StatusCode != http.StatusOK:
		// The agent refused the question: never a reason to fail open.
		return Answer{}, fmt.Errorf("agent answered %s: %s", resp.Status, strings.TrimSpace(string(b)))
	}
	var ans Answer
	if err := json.Unmarshal(b, &ans); err != nil {
		return Answer{}, fmt.Errorf("decode answer: %w", err)
	}
	return ans, nil
}

// Main runs the plugin with the process's environment, stdin and stdout.
func Main() {
	if os.Getenv("CNI_COMMAND") == "DEL" {
		// Outside skel: even a configuration it would reject must not fail
		// a DEL, or the runtime could never release the sandbox.
		stdin, _ := io.ReadAll(io.LimitReader(os.Stdin, 1<<20))
		Del(stdin, os.Getenv)
		return
	}
	skel.PluginMainFuncs(skel.CNIFuncs{Add: Add, Check: Check, Del: Noop, GC: Noop, Status: Noop},
		version.All, "mtlsbridge-cni: lets a pod start only when mtlsbridge has its mTLS redirection in place (chained after Cilium)")
}
