package testkit

import (
	"errors"
	"fmt"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestNATSServesPublishSubscribeAndJetStream(t *testing.T) {
	t.Parallel()
	s, nc := NATS(t)
	require.True(t, s.JetStreamEnabled())
	require.Contains(t, s.ClientURL(), "127.0.0.1")
	ch := Subscribe(t, nc, "kvactors.e1.>")
	require.NoError(t, nc.Publish("kvactors.e1.released", []byte(`{"request":"r1"}`)))
	m := Recv(t, ch, 5*time.Second, "the released message")
	require.Equal(t, "kvactors.e1.released", m.Subject)
	NoRecv(t, ch, 10*time.Millisecond, "a second message")

	other := Connect(t, s)
	require.NoError(t, other.Publish("kvactors.e1.stored", nil))
	require.Equal(t, "kvactors.e1.stored", Recv(t, ch, 5*time.Second, "the stored message").Subject)
}

func TestEventuallyPollsUntilNil(t *testing.T) {
	t.Parallel()
	var calls atomic.Int32
	Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if n := calls.Add(1); n < 3 {
			return fmt.Errorf("%d calls", n)
		}
		return nil
	})
	require.Equal(t, int32(3), calls.Load())
}

// fakeTB records the failure that a helper reports, and ends the goroutine
// as testing.T.Fatalf does.
type fakeTB struct {
	testing.TB
	failure string
}

func (f *fakeTB) Helper() {}

func (f *fakeTB) Fatalf(format string, args ...any) {
	f.failure = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

// failure runs fn against a fakeTB in its own goroutine (Fatalf ends it) and
// returns the failure message.
func failure(t *testing.T, fn func(tb testing.TB)) string {
	f := &fakeTB{TB: t}
	done := make(chan struct{}, 1)
	go func() {
		defer func() { done <- struct{}{} }() // runs on Goexit too
		fn(f)
	}()
	Recv(t, done, 10*time.Second, "the helper to return or fail")
	return f.failure
}

func TestEventuallyFailsWithTheLastError(t *testing.T) {
	t.Parallel()
	msg := failure(t, func(tb testing.TB) {
		Eventually(tb, 20*time.Millisecond, time.Millisecond, func() error { return errors.New("2 of 3 chunks stored") })
	})
	require.Equal(t, "still waiting after 20ms: 2 of 3 chunks stored", msg)
}

func TestRecvFailsNamingWhatItWaitedFor(t *testing.T) {
	t.Parallel()
	msg := failure(t, func(tb testing.TB) { Recv(tb, make(chan int), 10*time.Millisecond, "released for r1") })
	require.Equal(t, "timed out after 10ms waiting for released for r1", msg)

	closed := make(chan int)
	close(closed)
	msg = failure(t, func(tb testing.TB) { Recv(tb, closed, time.Second, "a job") })
	require.Equal(t, "waiting for a job: channel closed", msg)

	full := make(chan int, 1)
	full <- 7
	msg = failure(t, func(tb testing.TB) { NoRecv(tb, full, time.Second, "a second released") })
	require.Equal(t, "unexpected a second released: 7", msg)

	msg = failure(t, func(tb testing.TB) { NoRecv(tb, closed, time.Second, "the copy's end") })
	require.Equal(t, "unexpected the copy's end: channel closed", msg)
}

// NoRecv with no wait at all still sees what is there already: with the
// timer fired too, a select would pick either case at random (a review
// measured 503 of 1,000 such checks passing).
func TestNoRecvWithNoWaitSeesWhatIsThere(t *testing.T) {
	t.Parallel()
	for range 200 {
		full := make(chan int, 1)
		full <- 7
		msg := failure(t, func(tb testing.TB) { NoRecv(tb, full, 0, "a second released") })
		require.Equal(t, "unexpected a second released: 7", msg)
	}
}

func TestEveryCallsUntilStopAndNotAfter(t *testing.T) {
	t.Parallel()
	var calls atomic.Int32
	var stopped atomic.Bool
	inCall, late := make(chan struct{}, 1), make(chan int32, 1)
	release := make(chan struct{})
	stop := Every(t, time.Millisecond, func() {
		n := calls.Add(1)
		if stopped.Load() {
			select {
			case late <- n:
			default:
			}
		}
		if n == 3 {
			inCall <- struct{}{}
			<-release // the third call is in progress when stop is called
		}
	})
	Recv(t, inCall, 5*time.Second, "the third call")
	returned := make(chan struct{})
	go func() { stop(); close(returned) }()
	NoRecv(t, returned, 20*time.Millisecond, "stop returning while a call is in progress")
	close(release)
	Closed(t, returned, 5*time.Second, "stop's return after the call ended")
	require.Equal(t, int32(3), calls.Load(), "no call started once stop was called")
	stopped.Store(true)
	stop() // again: returns at once
	NoRecv(t, late, 10*time.Millisecond, "a call after stop returned")
}

func TestEveryStopsAtTheTestsEnd(t *testing.T) {
	t.Parallel()
	var calls atomic.Int32
	var ended atomic.Bool
	late := make(chan int32, 1)
	t.Run("inner", func(t *testing.T) {
		Every(t, time.Millisecond, func() {
			n := calls.Add(1)
			if ended.Load() {
				select {
				case late <- n:
				default:
				}
			}
		})
		Eventually(t, 5*time.Second, time.Millisecond, func() error {
			if n := calls.Load(); n < 2 {
				return fmt.Errorf("%d calls", n)
			}
			return nil
		})
	})
	ended.Store(true)
	NoRecv(t, late, 10*time.Millisecond, "a call after the test that started it ended")
}
