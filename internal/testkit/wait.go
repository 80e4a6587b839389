package testkit

import (
	"testing"
	"time"
)

// Eventually calls f every poll until it returns nil, and fails the test if
// it still returns an error after total: "still waiting after 5s: <f's last
// error>". f's error should say what is missing ("3 of 4 chunks stored"), as
// it becomes the failure message (nats-server's checkFor habit).
func Eventually(t testing.TB, total, poll time.Duration, f func() error) {
	t.Helper()
	deadline := time.NewTimer(total)
	defer deadline.Stop()
	tick := time.NewTicker(poll)
	defer tick.Stop()
	for {
		err := f()
		if err == nil {
			return
		}
		select {
		case <-deadline.C:
			// One last look, so that a condition met while waiting for the
			// tick does not fail.
			if err = f(); err == nil {
				return
			}
			t.Fatalf("still waiting after %v: %v", total, err)
			return
		case <-tick.C:
		}
	}
}

// Recv reads one value from ch, failing the test if none arrives within
// timeout or ch is closed; what names the value in the failure ("released
// for r1").
func Recv[T any](t testing.TB, ch <-chan T, timeout time.Duration, what string) T {
	t.Helper()
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case v, ok := <-ch:
		if !ok {
			t.Fatalf("waiting for %s: channel closed", what)
		}
		return v
	case <-timer.C:
		t.Fatalf("timed out after %v waiting for %s", timeout, what)
	}
	var zero T
	return zero // not reached: Fatalf ends the test goroutine
}

// NoRecv fails the test if a value arrives on ch within d, or ch is closed;
// what names what must not arrive ("a second released for r1"). A close
// counts: a channel closed to signal an event (done, returned) would
// otherwise pass here at once. Use it only to check that something does not
// happen, after the thing it would follow has been seen.
func NoRecv[T any](t testing.TB, ch <-chan T, d time.Duration, what string) {
	t.Helper()
	unexpected := func(v T, ok bool) {
		t.Helper()
		if !ok {
			t.Fatalf("unexpected %s: channel closed", what)
		}
		t.Fatalf("unexpected %s: %v", what, v)
	}
	// What is there already first: with d 0 (or a timer that has fired by
	// the select) both cases would be ready, and select picks one at random.
	select {
	case v, ok := <-ch:
		unexpected(v, ok)
	default:
	}
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case v, ok := <-ch:
		unexpected(v, ok)
	case <-timer.C:
	}
}

// Closed waits until ch is closed (or yields a value), failing the test
// after timeout; what names what the close means ("the engine actor's
// stop").
func Closed(t testing.TB, ch <-chan struct{}, timeout time.Duration, what string) {
	t.Helper()
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case <-ch:
	case <-timer.C:
		t.Fatalf("timed out after %v waiting for %s", timeout, what)
	}
}
