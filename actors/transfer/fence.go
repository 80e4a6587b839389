package transfer

import (
	"errors"
	"sync"
	"sync/atomic"
	"time"
)

// Errors of a copy the fence refuses; its pool side is aborted and its
// owner gets them in JobDone.
var (
	// ErrFenceClosed: the node stopped while the copy was waiting for a
	// fresh NATS round trip.
	ErrFenceClosed = errors.New("node stopping: copy not started (no fresh NATS round trip)")
	// ErrSessionLapsed: the copy belongs to a session that began before a
	// lapse (no round trip for 3/4 lease): an engine may have declared this
	// node lost since, and reused the blocks the copy reads or writes.
	ErrSessionLapsed = errors.New("session lapsed: an engine may have declared this node lost since the copy's session began; copy not started")
	// ErrFencedMidCopy: a copy that started before the fence is stopped
	// before its next device call once no NATS round trip has completed
	// for lease/2 (the fence holds every device call, not only a job's
	// first); its owner retries it as any failed copy.
	ErrFencedMidCopy = errors.New("fenced: no NATS round trip for lease/2; the copy stopped before its next device call")
)

// ErrQueueClosed fails a job submitted after the copy queue closed (the node
// stopping): it never ran.
var ErrQueueClosed = errors.New("node stopping: copy queue closed; copy not started")

// ErrCopyPanicked is a copy whose Store.Copy panicked (a backend's bug,
// recovered): its pool side is aborted and its owner retries it.
var ErrCopyPanicked = errors.New("copy panicked")

// Fence holds back device copies while the node may be cut off from NATS
// (PROTOCOL.md "Fencing, node side"): no copy starts when the last completed
// round trip with NATS began Lease/2 or more ago, and a copy still running
// 5/8 Lease after it is overdue (the node then fail-stops). Round trips are
// reported by the node's pinger; the copy workers call Enter and Leave.
//
// It also records lapses: Lease − Lease/4 without a round trip. The node
// heartbeats every Lease/4, so an engine's last sight of it may be that much
// older than the last round trip, and the engine may declare it lost from
// then on. A copy carries the generation of the session it belongs to
// (Gen, when the session began); one whose session began before a lapse, or
// during one, never starts (ErrSessionLapsed).
type Fence struct {
	lease time.Duration
	now   func() time.Time

	mu      sync.Mutex
	fresh   *sync.Cond
	last    time.Time // when the last completed round trip was sent
	running int
	closed  bool
	waits   func() // counts a copy that had to wait (may be nil)
	// gen moves twice per lapse: when it is recorded and when the round
	// trip that ends it completes, so a stamp taken during the lapse is
	// stale too. Written under mu; read without it by Gen.
	gen     atomic.Uint64
	lapsed  bool   // a lapse is recorded and no round trip has ended it yet
	onLapse func() // run once per lapse, outside mu (may be nil)
	onEnd   func() // run when a round trip ends a lapse, outside mu (may be nil)
	// ending runs under mu just before a round trip ends a lapse, with the
	// generation about to begin (may be nil): the node marks there which
	// messages were read before the round trip's answer.
	ending func(gen uint64)
}

// NewFence starts a fence whose last round trip is now (the connect).
func NewFence(lease time.Duration, now func() time.Time, waits func()) *Fence {
	f := &Fence{lease: lease, now: now, last: now(), waits: waits}
	f.fresh = sync.NewCond(&f.mu)
	return f
}

// OnLapse sets fn to run once per lapse, when it is recorded, on the
// goroutine that noticed it and without the fence's lock (the node resyncs
// and resets its engines there).
func (f *Fence) OnLapse(fn func()) {
	f.mu.Lock()
	f.onLapse = fn
	f.mu.Unlock()
}

// OnLapseEnd sets fn to run when a round trip ends a lapse (Gen moves
// again), on the goroutine that reported it, without the fence's lock: the
// node lets its engines send the resync orders they held (engine.Lapsed).
func (f *Fence) OnLapseEnd(fn func()) {
	f.mu.Lock()
	f.onEnd = fn
	f.mu.Unlock()
}

// OnLapseEnding sets fn to run, under the fence's lock, just before a
// round trip ends a lapse, with the generation that then begins: whatever
// the round trip's caller read before its answer (the node: messages off
// NATS) is known to it then, including when one round trip both records
// and ends a lapse. fn must not call the fence.
func (f *Fence) OnLapseEnding(fn func(gen uint64)) {
	f.mu.Lock()
	f.ending = fn
	f.mu.Unlock()
}

// Gen is the lapse generation: a session (an engine's epoch, a load) is
// stamped with it when it begins, and its copies start only while it is
// unchanged.
func (f *Fence) Gen() uint64 { return f.gen.Load() }

// lapseAfter is how long without a round trip before an engine may have
// declared this node lost.
func (f *Fence) lapseAfter() time.Duration { return f.lease - f.lease/4 }

// lapseLocked records a lapse if none is recorded and now is lapseAfter or
// more past the last round trip; it returns the callback to run (without
// the lock) when it recorded one. Call with mu held.
func (f *Fence) lapseLocked(now time.Time) (recorded bool, onLapse func()) {
	if f.lapsed || now.Sub(f.last) < f.lapseAfter() {
		return false, nil
	}
	f.lapsed = true
	f.gen.Add(1)
	return true, f.onLapse
}

// recorded wakes the waiting copies to check their stamp and runs onLapse
// (nil: none); call without mu.
func (f *Fence) recorded(onLapse func()) {
	f.fresh.Broadcast()
	if onLapse != nil {
		onLapse()
	}
}

// RoundTrip records a round trip with NATS that was sent at sent and has
// completed; waiting copies start. A gap since the last one of lapseAfter or
// more (at completion) is a lapse, recorded before the round trip moves the
// fence on, and the round trip that ends a lapse moves Gen again.
func (f *Fence) RoundTrip(sent time.Time) {
	f.mu.Lock()
	now := f.now()
	_, onLapse := f.lapseLocked(now)
	var onEnd func()
	if sent.After(f.last) {
		f.last = sent
		if f.lapsed && now.Sub(f.last) < f.lapseAfter() {
			f.lapsed = false
			if f.ending != nil {
				f.ending(f.gen.Load() + 1)
			}
			f.gen.Add(1)
			onEnd = f.onEnd
		}
	}
	f.mu.Unlock()
	f.recorded(onLapse) // wakes the waiting copies either way
	if onEnd != nil {
		onEnd()
	}
}

// Check records a lapse that has begun by now although no round trip came
// to show it (the node's watchdog calls it periodically), so waiting copies
// of the old session end and the engines are reset during the outage.
func (f *Fence) Check(now time.Time) {
	f.mu.Lock()
	rec, onLapse := f.lapseLocked(now)
	f.mu.Unlock()
	if rec {
		f.recorded(onLapse)
	}
}

// Enter blocks until a copy of the session stamped session may start (the
// last round trip is younger than Lease/2), then counts it running. It
// fails once the fence is closed (ErrFenceClosed) or once Gen differs from
// session (ErrSessionLapsed), also after a wait.
func (f *Fence) Enter(session uint64) error {
	f.mu.Lock()
	waited := false
	for {
		if f.closed {
			f.mu.Unlock()
			return ErrFenceClosed
		}
		now := f.now()
		if rec, onLapse := f.lapseLocked(now); rec {
			f.mu.Unlock()
			f.recorded(onLapse)
			f.mu.Lock()
			continue
		}
		if session != f.gen.Load() {
			f.mu.Unlock()
			return ErrSessionLapsed
		}
		if now.Sub(f.last) < f.lease/2 {
			break
		}
		if !waited && f.waits != nil {
			f.waits()
		}
		waited = true
		f.fresh.Wait()
	}
	f.running++
	f.mu.Unlock()
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

// Overdue reports whether a copy is running 5/8 Lease or more after the
// last round trip (overdueAfter): the watchdog, looking every Lease/8, then
// ends the process before 3/4 Lease, from when an engine may have declared
// this node lost (heartbeats go out every Lease/4, so its last one may be
// that much older than the round trip). PROTOCOL.md's bound is a Lease.
func (f *Fence) Overdue(now time.Time) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.running > 0 && now.Sub(f.last) >= f.overdueAfter()
}

// overdueAfter is how long a copy may run past the last round trip: the
// watchdog looks every Lease/8, so it fail-stops a copy overdue at 5/8 Lease
// by 3/4, before an engine may declare the node lost (lapseAfter).
func (f *Fence) overdueAfter() time.Duration { return f.lapseAfter() - f.lease/8 }

// Close releases every waiting copy with ErrFenceClosed.
func (f *Fence) Close() {
	f.mu.Lock()
	f.closed = true
	f.mu.Unlock()
	f.fresh.Broadcast()
}
