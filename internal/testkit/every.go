package testkit

import (
	"sync"
	"testing"
	"time"
)

// Every calls do on a goroutine of its own every period, as a process's
// heartbeat or keep-alive loop does, until stop is called or the test ends.
// stop waits for a call in progress, so nothing do touches is used after it
// returns; it may be called more than once. do runs off the test goroutine,
// so it must not call t.Fatal (report through a channel or an atomic).
//
// The calls go out on a ticker, not one period after the last call ended:
// a slow call on a loaded machine does not stretch the gap between two past
// what the test meant (a lease, say); ticks missed meanwhile are dropped.
func Every(t testing.TB, period time.Duration, do func()) (stop func()) {
	t.Helper()
	quit := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		tick := time.NewTicker(period)
		defer tick.Stop()
		for {
			select {
			case <-quit:
				return
			case <-tick.C:
			}
			select { // a tick and quit both ready: quit wins, so no call starts after stop
			case <-quit:
				return
			default:
			}
			do()
		}
	})
	stop = sync.OnceFunc(func() { close(quit); wg.Wait() })
	t.Cleanup(stop)
	return stop
}
