package request

import (
	"github.com/asynkron/protoactor-go/actor"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// armRetry schedules one RetryDue; the timer only sends a message, so the
// decision itself still runs in Receive. A retry for keys pending in other
// copies is also due as soon as one of those copies ends: the timer is the
// fallback (a store that supports waiting, PendingWaiter).
func (a *Actor) armRetry(c actor.Context, r *sched.Retry, pending []messages.Key) {
	if a.retryArmed {
		return
	}
	a.retryArmed = true
	a.arm++
	a.deps.Timers.Send(r.Backoff, c.Self(), &RetryDue{gen: a.gen, arm: a.arm})
	if w, ok := a.deps.Store.(PendingWaiter); ok && len(pending) > 0 {
		w.WaitPending(pending, &pendingWake{timers: a.deps.Timers, to: c.Self(), due: RetryDue{gen: a.gen, arm: a.arm}})
	}
}

// PendingWaiter is a Store that can wake a retry when a copy it waited for
// ends (hostpool.Shared.WaitPending).
type PendingWaiter interface {
	WaitPending(keys []messages.Key, w hostpool.Waker)
}

// pendingWake sends its retry's RetryDue through the engine's timers, due
// now: the copy's end is on the transfer side's goroutine, and the decision
// belongs on the request's own turn, as a timer's does.
type pendingWake struct {
	timers *actors.Timers
	to     *actor.PID
	due    RetryDue
}

func (w *pendingWake) Wake() {
	due := w.due
	w.timers.Send(0, w.to, &due)
}
