package request

import (
	"sync/atomic"

	"github.com/asynkron/protoactor-go/actor"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// armRetry schedules one RetryDue; the timer only sends a message, so the
// decision itself still runs in Receive. A retry for keys pending in other
// copies is also due as soon as one of those copies ends, and one for room
// when its turn in the pool's room queue comes: the timer is the fallback
// (a store that supports waiting, RetryWaiter).
//
// A retry armed while an earlier one's timer still runs (an early wake-up
// that failed again) takes that timer over instead of starting its own:
// woken failures do not count towards FinishRetryLimit (sched), so were
// each to start a timer anew, wake-ups coming faster than the backoff would
// keep every timer from falling due, and a finished request the pool keeps
// refusing would never give up and be released.
//
// armed: no retry was armed, and r now is; timed: it started its own timer
// (after r.Backoff), rather than taking over a running one.
func (a *Actor) armRetry(c actor.Context, r *sched.Retry, pending []messages.Key, roomGen uint64) (armed, timed bool) {
	if a.retryArmed {
		return false, false // the armed retry decides again: r schedules nothing
	}
	a.retryArmed = true
	a.arm++
	if a.timer == 0 {
		a.timer = a.arm
		a.deps.Timers.Send(r.Backoff, c.Self(), &RetryDue{gen: a.gen, arm: a.arm})
		timed = true
	}
	switch w, ok := a.deps.Store.(RetryWaiter); {
	case !ok:
	case len(pending) > 0:
		w.WaitPending(pending, a.wake(c))
	case r.Reason == sched.RetryPoolFull:
		w.WaitRoom(a.wake(c), roomGen)
	}
	return true, timed
}

// wake is the armed retry's early wake-up.
func (a *Actor) wake(c actor.Context) *retryWake {
	if a.waiting == nil {
		a.waiting = new(atomic.Uint64)
	}
	key := waitKey(a.gen, a.arm)
	a.waiting.Store(key)
	return &retryWake{timers: a.deps.Timers, to: c.Self(), due: RetryDue{gen: a.gen, arm: a.arm, woken: true},
		waiting: a.waiting, key: key}
}

// stopWaiting: the armed retry is taken; its wake-ups still queued are stale.
func (a *Actor) stopWaiting() {
	if a.waiting != nil {
		a.waiting.Store(0)
	}
}

func waitKey(gen, arm uint32) uint64 { return uint64(gen)<<32 | uint64(arm) }

// RetryWaiter is a Store that can wake a retry when a copy it waited for
// ends (hostpool.Shared.WaitPending), or when room may have freed
// (hostpool.Shared.WaitRoom).
type RetryWaiter interface {
	WaitPending(keys []messages.Key, w hostpool.Waker)
	WaitRoom(w hostpool.Waker, seen uint64)
}

// retryWake sends its retry's RetryDue through the engine's timers, due
// now: the copy's end is on the transfer side's goroutine, and the decision
// belongs on the request's own turn, as a timer's does.
type retryWake struct {
	timers  *actors.Timers
	to      *actor.PID
	due     RetryDue
	waiting *atomic.Uint64 // the actor's
	key     uint64         // this retry's waitKey
}

// Stale: the retry was taken (or the actor serves another request): the
// room queue passes the wake-up on to the next waiter.
func (w *retryWake) Stale() bool { return w.waiting.Load() != w.key }

func (w *retryWake) Wake() {
	due := w.due
	w.timers.Send(0, w.to, &due)
}
