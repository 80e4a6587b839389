package transfer

import (
	"errors"
	"sync/atomic"
	"time"
)

// ErrEngineSilent is a copy refused because its engine has not been heard
// from for Config.EngineSilence: it never starts, its pool side is aborted,
// and its owner retries it once the engine speaks again.
var ErrEngineSilent = errors.New("engine silent: no message from it for lease/2; copy not started")

// Hearing is when the node last heard from an engine: the node-side fence
// for a link that fails on the engine's side only (PROTOCOL.md "Fencing,
// node side"). Such an engine declares the node lost a lease after it last
// heard the node, and may reuse its blocks a lease after its own last
// publish; the node, whose NATS is fine, would go on copying. So no copy
// of an engine starts once the node has heard nothing from it for lease/2,
// counted from when its last message was taken off NATS. Engines send a
// sign of life at least every lease/4, so a live one is never refused.
type Hearing struct{ at atomic.Int64 } // UnixNano

// Heard records a message of the engine taken at at; it never moves back.
func (h *Hearing) Heard(at time.Time) {
	v := at.UnixNano()
	for cur := h.at.Load(); v > cur; cur = h.at.Load() {
		if h.at.CompareAndSwap(cur, v) {
			return
		}
	}
}

// Silent is how long before now the engine was last heard (0 if never).
func (h *Hearing) Silent(now time.Time) time.Duration {
	at := h.at.Load()
	if at == 0 {
		return 0
	}
	return now.Sub(time.Unix(0, at))
}

// heardRecently refuses job when its engine has been silent for the
// configured window (no Hearing, or no window: never refused).
func (a *Actor) heardRecently(job *Submit) error {
	if job.Hearing == nil || a.deps.Config.EngineSilence <= 0 {
		return nil
	}
	if job.Hearing.Silent(a.now()) >= a.deps.Config.EngineSilence {
		return ErrEngineSilent
	}
	return nil
}

func (a *Actor) now() time.Time {
	if a.deps.Now != nil {
		return a.deps.Now()
	}
	return time.Now()
}
