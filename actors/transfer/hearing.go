package transfer

import (
	"errors"
	"sync/atomic"
	"time"
)

// ErrEngineSilent is a copy refused because its engine has not been heard
// from for Config.EngineSilence: it never starts, its pool side is aborted,
// and its owner retries it once the engine speaks again. A copy that was
// running when its engine fell silent is stopped the same way, between two
// device calls (Store.Copy's live check), its pool side completed as failed.
var ErrEngineSilent = errors.New("engine silent: no message from it for lease/2; copy refused or stopped")

// Hearing is when the node last heard from an engine: the node-side fence
// for a link that fails on the engine's side only (PROTOCOL.md "Fencing,
// node side"). Such an engine declares the node lost a lease after it last
// heard the node, and may reuse its blocks a lease after its own last
// publish; the node, whose NATS is fine, would go on copying. So no copy
// of an engine starts once the node has heard nothing from it for lease/2,
// counted from when its last message was taken off NATS. Engines send a
// sign of life at least every lease/4, so a live one is never refused.
type Hearing struct {
	// at is when the engine was last heard, as its time since clockBase
	// (sinceBase; 0: never).
	at atomic.Uint64
	// state is gen<<1 | silenced, in one word so a resume can be told from
	// a silence that ended after its message was taken (ResumedIn).
	//
	// gen counts the silences that ended. A copy carries the generation
	// its session (an epoch's requests, a load) began in
	// (Submit.HearingGen) and never starts in a later one: the message that
	// ends a silence refreshes at, and the reset of the old requests it
	// brings reaches their queued copies and retries only a few hops later.
	//
	// silenced: a silence of lease/2 ended and the engine has not begun a
	// new epoch since (Silenced, ResumedIn). A load arriving meanwhile may be
	// one the engine sent before it declared the node lost, delivered late
	// (a stalled NATS route), into blocks it has since reused: refused.
	state atomic.Uint64
}

// Gen is the count of silences that ended (Submit.HearingGen).
func (h *Hearing) Gen() uint64 { return h.state.Load() >> 1 }

// Silenced marks that a silence ended, before the message that ended it
// refreshes the time: copies of sessions begun before are refused from now
// on, and loads until ResumedIn.
func (h *Hearing) Silenced() {
	for {
		old := h.state.Load()
		if h.state.CompareAndSwap(old, (old|1)+2) { // gen+1, silenced
			return
		}
	}
}

// ResumedIn: the engine began a new epoch with a message taken in
// generation gen: its loads are its own, current ones, unless a silence
// ended after that message was taken (an epoch begun by a message that
// waited in the actor's mailbox through a silence is no sign the engine
// came back).
func (h *Hearing) ResumedIn(gen uint64) { h.state.CompareAndSwap(gen<<1|1, gen<<1) }

// LoadsRefused reports whether a silence ended and the engine has not begun
// a new epoch since.
func (h *Hearing) LoadsRefused() bool { return h.state.Load()&1 == 1 }

// clockBase is what a Hearing measures its times from. They were kept as
// UnixNano, which drops a time's monotonic reading, so silences were
// measured on the wall clock: an NTP step or a resumed VM moving it lease/2
// forward ended a "silence" of every engine at once (their work reset),
// and one moving it back hid real silences for as long as the step (the
// node-side fence open). A time.Time's Sub uses the monotonic readings
// where both times carry one (time.Now's), the wall clock otherwise (test
// clocks).
var clockBase = time.Now()

// sinceBase is t's time since clockBase in an order-keeping unsigned form:
// its sign bit flipped, so that earlier is smaller and 0 (a Duration's
// least value, 292 years before clockBase) can stand for never.
func sinceBase(t time.Time) uint64 { return uint64(t.Sub(clockBase)) ^ 1<<63 }

// Heard records a message of the engine taken at at; it never moves back.
func (h *Hearing) Heard(at time.Time) {
	v := sinceBase(at)
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
	return time.Duration(sinceBase(now) - at) // wraps as signed: now before at is negative
}

// heardRecently refuses job when its engine has been silent for the
// configured window, or was since the job's session began (no Hearing, or
// no window: never refused). It is asked before the copy starts and, while
// it runs, between its device calls (live).
func (a *Actor) heardRecently(job *Submit) error {
	if job.Hearing == nil || a.deps.Config.EngineSilence <= 0 {
		return nil
	}
	if job.HearingGen != job.Hearing.Gen() || job.Hearing.Silent(a.now()) >= a.deps.Config.EngineSilence {
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

// liveCheck is a worker's check for Store.Copy before each device call
// after a copy's first: the fence (no device call starts once no NATS round
// trip has completed for lease/2: a job of many tiles, or a load reading
// chunks back from disk, must not go on past it) and heardRecently, the
// rule the copy started under. A worker runs one copy at a time, so one
// check, bound once, serves every copy it runs: a closure per job was a
// heap allocation per copy.
type liveCheck struct {
	a     *Actor
	job   *Submit // the copy the worker runs now
	check func() error
}

func (a *Actor) newLiveCheck() *liveCheck {
	lc := &liveCheck{a: a}
	lc.check = lc.run
	return lc
}

// of is the check for job, which the worker is about to copy; nil when
// there is nothing to check.
func (lc *liveCheck) of(job *Submit) func() error {
	lc.job = job
	if lc.a.deps.Fence == nil && (job.Hearing == nil || lc.a.deps.Config.EngineSilence <= 0) {
		return nil
	}
	return lc.check
}

func (lc *liveCheck) run() error {
	if f := lc.a.deps.Fence; f != nil && f.Fenced() {
		return ErrFencedMidCopy
	}
	return lc.a.heardRecently(lc.job)
}
