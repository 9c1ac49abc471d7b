// SPDX-License-Identifier: Apache-2.0

package inpod

import (
	"os"
	"runtime"
	"testing"
)

// The main goroutine keeps the main thread, the one /proc/self names,
// and runs there what tests send on mainThread.
func init() { runtime.LockOSThread() }

var mainThread = make(chan func())

func TestMain(m *testing.M) {
	exit := make(chan int)
	go func() { exit <- m.Run() }()
	for {
		select {
		case fn := <-mainThread:
			fn()
		case code := <-exit:
			os.Exit(code)
		}
	}
}
