// SPDX-License-Identifier: Apache-2.0

// Command xdstrace breaks the xDS change latency down into its steps,
// from an execution trace of BenchmarkXDSChangeLatency:
//
//	go test -run '^$' -bench 'BenchmarkXDSChangeLatency/mtlsbridge/100000' \
//	    -benchtime 1x -trace /tmp/xds.trace ./xds/
//	go run ./hack/xdstrace /tmp/xds.trace
//
// The benchmark logs "commit" and "committed" around its write and
// "received" when the client has the change; the server marks its push
// ("xds push") and the gRPC send ("xds send") as regions. The goroutine
// transitions in between tell hand-offs (runnable -> running) apart from
// work, and the server's TLS write syscall splits gRPC's writer from the
// wire and the client.
package main

import (
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"time"

	"golang.org/x/exp/trace"
)

type mark struct {
	at time.Duration
	g  trace.GoID
}

// events are the parts of a trace the breakdown reads.
type events struct {
	logs      map[string][]mark // message -> marks
	regions   map[string][][2]mark
	runnable  map[trace.GoID][]time.Duration
	running   map[trace.GoID][]time.Duration
	tlsWrites []mark // the xDS server's TLS writes (gRPC's loopy writer)
	// clientReaders are the goroutines reading the client's connection.
	clientReaders map[trace.GoID]bool
}

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: xdstrace TRACE-FILE")
		os.Exit(2)
	}
	ev, err := read(os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, "xdstrace:", err)
		os.Exit(1)
	}
	steps, n := breakdown(ev)
	if n == 0 {
		fmt.Fprintln(os.Stderr, "xdstrace: no change found (was the trace taken of BenchmarkXDSChangeLatency/mtlsbridge?)")
		os.Exit(1)
	}
	// The slowest changes, step by step: what makes the tail.
	total := steps[len(steps)-1].took
	order := make([]int, n)
	for i := range order {
		order[i] = i
	}
	slices.SortFunc(order, func(a, b int) int { return int(total[b] - total[a]) })
	slowest := order[:max(1, n/50)]
	fmt.Printf("%d changes; per step p50 / p99, and the slowest 2%% (us):\n", n)
	for _, s := range steps {
		fmt.Printf("  %-56s", s.name)
		for _, i := range slowest {
			fmt.Printf(" %7.1f", us(s.took[i]))
		}
		sorted := slices.Sorted(slices.Values(s.took))
		fmt.Printf("   | %7.1f %7.1f\n", us(sorted[len(sorted)/2]), us(sorted[len(sorted)*99/100]))
	}
}

func us(d time.Duration) float64 { return float64(d) / 1e3 }

func read(path string) (*events, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	r, err := trace.NewReader(f)
	if err != nil {
		return nil, err
	}
	ev := &events{
		logs: map[string][]mark{}, regions: map[string][][2]mark{},
		runnable: map[trace.GoID][]time.Duration{}, running: map[trace.GoID][]time.Duration{},
		clientReaders: map[trace.GoID]bool{},
	}
	open := map[trace.GoID]map[string]mark{}
	var origin trace.Time
	for {
		e, err := r.ReadEvent()
		if err == io.EOF {
			return ev, nil
		}
		if err != nil {
			return nil, err
		}
		if origin == 0 {
			origin = e.Time()
		}
		m := mark{at: time.Duration(e.Time() - origin), g: e.Goroutine()}
		switch e.Kind() {
		case trace.EventLog:
			if l := e.Log(); l.Category == "xds-bench" {
				ev.logs[l.Message] = append(ev.logs[l.Message], m)
			}
		case trace.EventRegionBegin:
			if open[m.g] == nil {
				open[m.g] = map[string]mark{}
			}
			open[m.g][e.Region().Type] = m
		case trace.EventRegionEnd:
			typ := e.Region().Type
			if begin, ok := open[m.g][typ]; ok {
				ev.regions[typ] = append(ev.regions[typ], [2]mark{begin, m})
			}
		case trace.EventStateTransition:
			st := e.StateTransition()
			if st.Resource.Kind != trace.ResourceGoroutine {
				continue
			}
			g := st.Resource.Goroutine()
			switch _, to := st.Goroutine(); to {
			case trace.GoRunnable:
				ev.runnable[g] = append(ev.runnable[g], m.at)
			case trace.GoRunning:
				ev.running[g] = append(ev.running[g], m.at)
			case trace.GoWaiting:
				if inStack(st.Stack, "(*http2Client).reader") {
					ev.clientReaders[g] = true
				}
			case trace.GoSyscall:
				if serverTLSWrite(st.Stack) {
					ev.tlsWrites = append(ev.tlsWrites, mark{at: m.at, g: g})
				}
			}
		}
	}
}

func inStack(s trace.Stack, fn string) bool {
	for f := range s.Frames() {
		if strings.Contains(f.Func, fn) {
			return true
		}
	}
	return false
}

// serverTLSWrite: a syscall made by gRPC's server transport writing TLS.
func serverTLSWrite(s trace.Stack) bool {
	var tlsWrite, server bool
	for f := range s.Frames() {
		tlsWrite = tlsWrite || f.Func == "crypto/tls.(*Conn).Write"
		server = server || strings.Contains(f.Func, "NewServerTransport")
	}
	return tlsWrite && server
}

type step struct {
	name string
	took []time.Duration
}

// breakdown follows each change from the benchmark's commit to the
// client's receipt.
func breakdown(ev *events) ([]*step, int) {
	names := []string{
		"build the workload, write and commit it",
		"committed -> push goroutine running (wake-up)",
		"running -> push begins (select, coalescing check)",
		"push: read changes, encode, queue",
		"queued -> sender running (hand-off)",
		"sender: grpc SendMsg (encode frame, hand to writer)",
		"SendMsg returned -> server TLS write syscall (writer)",
		"server TLS write -> client reader running (kernel, wake-up)",
		"client reader: read, decrypt, frame -> receiver runnable",
		"receiver runnable -> running (hand-off)",
		"receiver: gRPC message, find the change",
		"total: commit -> client has the change",
	}
	steps := make([]*step, len(names))
	for i, n := range names {
		steps[i] = &step{name: n}
	}
	after := func(ms []mark, t time.Duration) (mark, bool) {
		i, _ := slices.BinarySearchFunc(ms, t, func(m mark, t time.Duration) int { return int(m.at - t) })
		if i == len(ms) {
			return mark{}, false
		}
		return ms[i], true
	}
	regionAfter := func(typ string, t time.Duration) ([2]mark, bool) {
		rs := ev.regions[typ]
		i, _ := slices.BinarySearchFunc(rs, t, func(r [2]mark, t time.Duration) int { return int(r[0].at - t) })
		if i == len(rs) {
			return [2]mark{}, false
		}
		return rs[i], true
	}
	lastBefore := func(ts []time.Duration, t time.Duration) time.Duration {
		i, _ := slices.BinarySearch(ts, t)
		if i == 0 {
			return 0
		}
		return ts[i-1]
	}
	n := 0
	for _, commit := range ev.logs["commit"] {
		committed, ok1 := after(ev.logs["committed"], commit.at)
		received, ok2 := after(ev.logs["received"], committed.at)
		push, ok3 := regionAfter("xds push", committed.at)
		send, ok4 := regionAfter("xds send", push[1].at)
		write, ok5 := after(ev.tlsWrites, send[1].at)
		if !ok1 || !ok2 || !ok3 || !ok4 || !ok5 || received.at < write.at {
			continue
		}
		receiverRunnable := lastBefore(ev.runnable[received.g], received.at)
		receiverRunning := lastBefore(ev.running[received.g], received.at)
		var readerRunning time.Duration
		for g := range ev.clientReaders {
			if t := lastBefore(ev.running[g], receiverRunnable); t > readerRunning {
				readerRunning = t
			}
		}
		pushRunning := lastBefore(ev.running[push[0].g], push[0].at)
		senderRunning := lastBefore(ev.running[send[0].g], send[0].at)
		took := []time.Duration{
			committed.at - commit.at,
			pushRunning - committed.at,
			push[0].at - pushRunning,
			push[1].at - push[0].at,
			senderRunning - push[1].at,
			send[1].at - senderRunning,
			write.at - send[1].at,
			readerRunning - write.at,
			receiverRunnable - readerRunning,
			receiverRunning - receiverRunnable,
			received.at - receiverRunning,
			received.at - commit.at,
		}
		for i, d := range took {
			steps[i].took = append(steps[i].took, d)
		}
		n++
	}
	return steps, n
}
