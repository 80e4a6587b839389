package transfer

import (
	"errors"
	"sync"
	"time"
)

// ErrFenceClosed is a copy's error when the node stopped while the copy was
// waiting for a fresh NATS round trip.
var ErrFenceClosed = errors.New("node stopping: copy not started (no fresh NATS round trip)")

// Fence holds back device copies while the node may be cut off from NATS
// (PROTOCOL.md "Fencing, node side"): no copy starts when the last completed
// round trip with NATS began Lease/2 or more ago, and a copy still running
// Lease after it is overdue (the node then fail-stops). Round trips are
// reported by the node's pinger; the copy workers call Enter and Leave.
type Fence struct {
	lease time.Duration
	now   func() time.Time

	mu      sync.Mutex
	fresh   *sync.Cond
	last    time.Time // when the last completed round trip was sent
	running int
	closed  bool
	waits   func() // counts a copy that had to wait (may be nil)
}

// NewFence starts a fence whose last round trip is now (the connect).
func NewFence(lease time.Duration, now func() time.Time, waits func()) *Fence {
	f := &Fence{lease: lease, now: now, last: now(), waits: waits}
	f.fresh = sync.NewCond(&f.mu)
	return f
}

// RoundTrip records a round trip with NATS that was sent at sent and has
// completed; waiting copies start.
func (f *Fence) RoundTrip(sent time.Time) {
	f.mu.Lock()
	if sent.After(f.last) {
		f.last = sent
	}
	f.mu.Unlock()
	f.fresh.Broadcast()
}

// Enter blocks until a copy may start (the last round trip is younger than
// Lease/2), then counts it running. It fails only once the fence is closed.
func (f *Fence) Enter() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	waited := false
	for !f.closed && f.now().Sub(f.last) >= f.lease/2 {
		if !waited && f.waits != nil {
			f.waits()
		}
		waited = true
		f.fresh.Wait()
	}
	if f.closed {
		return ErrFenceClosed
	}
	f.running++
	return nil
}

// Leave ends a copy that Enter let start.
func (f *Fence) Leave() {
	f.mu.Lock()
	f.running--
	f.mu.Unlock()
}

// Fenced reports whether a copy would have to wait now.
func (f *Fence) Fenced() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.now().Sub(f.last) >= f.lease/2
}

// Overdue reports whether a copy is running Lease or more after the last
// round trip: the engine may already have declared this node lost.
func (f *Fence) Overdue(now time.Time) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.running > 0 && now.Sub(f.last) >= f.lease
}

// Close releases every waiting copy with ErrFenceClosed.
func (f *Fence) Close() {
	f.mu.Lock()
	f.closed = true
	f.mu.Unlock()
	f.fresh.Broadcast()
}
