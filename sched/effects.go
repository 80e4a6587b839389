package sched

import (
	"time"

	"github.com/kvactors/kvactors/messages"
)

// DeferReason names the term of the ready prefix that holds a chunk back.
type DeferReason uint8

const (
	DeferNone DeferReason = iota
	DeferTokens
	DeferHashes
	DeferBlocks
)

var deferNames = [...]string{"none", "tokens", "hashes", "blocks"}

// String is the metric label and span attribute value.
func (r DeferReason) String() string { return deferNames[r] }

// DeferLabels are the metric labels of every reason a chunk can be deferred
// for (metrics preset them at 0).
func DeferLabels() []string { return deferNames[DeferTokens:] }

// Deferral says chunk Chunk of group Group is not ready because of Reason. It
// is reported once per chunk per reason change, not once per event.
type Deferral struct {
	Group  int
	Chunk  messages.ChunkIndex
	Reason DeferReason
}

// Deferrals are one decision's deferrals, in group order. Most layouts have
// one or two groups, so they are kept inline: a decision that defers (most
// prefill steps, whose hashes trail their tokens) allocates nothing for
// them.
type Deferrals struct {
	n      int
	inline [2]Deferral
	more   []Deferral // every one of them, once past inline
}

func (d *Deferrals) add(x Deferral) {
	if d.more == nil && d.n < len(d.inline) {
		d.inline[d.n] = x
		d.n++
		return
	}
	if d.more == nil {
		d.more = append(make([]Deferral, 0, 2*len(d.inline)), d.inline[:d.n]...)
	}
	d.more = append(d.more, x)
}

// All lists the deferrals. The receiver is a copy, so the list is the
// caller's whatever becomes of the Effects it came from.
func (d Deferrals) All() []Deferral {
	if d.more != nil {
		return d.more
	}
	return d.inline[:d.n]
}

// RetryReason says why a store is retried.
type RetryReason uint8

const (
	RetryPoolFull RetryReason = iota + 1
	RetryCopyFailed
	// RetryPending: a chunk's key was pending in another copy, which may
	// still fail or be cancelled; the chunk is offered again until its key
	// is ready.
	RetryPending
)

var retryNames = [...]string{RetryPoolFull: "pool_full", RetryCopyFailed: "copy_failed", RetryPending: "pending"}

// String is the metric label and span attribute value.
func (r RetryReason) String() string {
	if int(r) < len(retryNames) && retryNames[r] != "" {
		return retryNames[r]
	}
	return retryNames[RetryPoolFull]
}

// RetryLabels are the metric labels of every retry reason.
func RetryLabels() []string { return retryNames[RetryPoolFull:] }

// Retry asks the caller to call Advance again after Backoff (a RetryDue
// timer); the next event of the request triggers it sooner.
type Retry struct {
	Reason  RetryReason
	Attempt int
	Backoff time.Duration
}

// Effects is the work Advance and JobDone hand back, in the order the caller
// performs it: cancel queued copies, start Job, count Evicted (the pool's
// journal announces them), record Deferred, schedule Retry, publish Releases.
// They are the caller's: the Request keeps no reference to their slices.
type Effects struct {
	Cancel   []JobID // queued copies of this request to cancel (preemption)
	Job      *StoreJob
	Evicted  int // ready chunks the pool evicted to make room
	Deduped  int // candidate chunks already present in the pool
	Deferred Deferrals
	Retry    *Retry
	// Pending, with a RetryPending Retry, are the keys other copies were
	// still filling: the caller may retry as soon as one of those copies
	// ends instead of waiting out the backoff (hostpool.Shared.WaitPending).
	Pending []messages.Key
	// RoomGen, with a RetryPoolFull Retry, is the pool's room generation
	// the failed decision saw (hostpool.Prepared.RoomGen): the caller's
	// wait for room wakes at once if room freed since.
	RoomGen uint64
	GivenUp int // ready chunks given up after the retry limit at finish
	// GivenUpReason, with GivenUp, is the failure that reached the limit.
	GivenUpReason RetryReason
	Releases      []string // reasons to publish on P.E.released, in order
	Done          bool     // the request is done: drop it after publishing Releases
	// More: the decision offered only part of the ready chunks (at most
	// what the pool holds: capToRoom) and made no job, so no completion will
	// call for the next one: the caller decides again (Advance) at once.
	More bool

	// woken: the decision is an early wake-up's (AdvanceWoken); a failure
	// then spends no retry attempt.
	woken bool
}

// Backoff policy for retries: doubling from RetryBase up to RetryMax.
const (
	RetryBase = 10 * time.Millisecond
	RetryMax  = time.Second
	// FinishRetryLimit bounds retries of a finished request: the engine holds
	// its GPU blocks until released, so after this many failed attempts the
	// remaining chunks are dropped (counted) and the request released.
	FinishRetryLimit = 16
)

func backoff(attempt int) time.Duration {
	d := RetryBase
	for i := 1; i < attempt && d < RetryMax; i++ {
		d *= 2
	}
	return min(d, RetryMax)
}
