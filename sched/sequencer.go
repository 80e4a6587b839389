package sched

import (
	"time"

	"github.com/kvactors/kvactors/messages"
)

// Sequencer holds one engine's session rules (PROTOCOL.md "EventBatch",
// "Sessions", "Delivery"): which epoch is live, the last batch applied in
// it, whether the epoch is being resynced, and when the engine last showed a
// sign of life. It is a plain value: the engine actor feeds it batches,
// heartbeats and losses with the time, and carries out the decision it
// returns (apply, reset, publish a resync, drop). It reads no clock.
type Sequencer struct {
	epoch   string
	applied uint64 // last batch seq applied in epoch; 0: none yet
	live    bool   // an epoch has been seen

	resyncing  bool // nothing more of epoch is applied
	expected   uint64
	got        uint64
	reason     string
	lastResync time.Time

	// repeat is the least time between two resyncs of one epoch (lease/4);
	// lease is how long the engine may stay silent before it expires.
	repeat, lease time.Duration
	lastSign      time.Time

	// lostNext is the reason of the last loss told (Lost) since an epoch
	// began (a loss makes the live epoch resync, so none of its batches is
	// applied after it): the next epoch's first batches may have
	// gone with it (the engine began one after the live epoch's resync, and
	// its seq 1 was dropped at a full intake before the Lost reached here,
	// while the old epoch was still live), so a gap the next epoch begins
	// with is resynced with that reason, not gap: an overflow's resync says
	// overflow, and the engine backs off. Beginning an epoch consumes it.
	lostNext string

	// ended are the epochs that ended last, newest at ended[0]: a heartbeat
	// or batch of one of them is late (an engine never returns to an epoch
	// it left; its heartbeat may be sent after its next epoch's first batch),
	// and must not end the live epoch.
	ended [endedEpochs]string
	// heir is the live epoch of the engine's earlier actor (Inherit): the
	// engine may go on with it here, but once another epoch begins it has
	// ended like any other.
	heir string
}

// endedEpochs is how many ended epochs a Sequencer remembers: late messages
// trail the epoch change by a round trip or so, not several epochs.
const endedEpochs = 4

// Verdict says what to do with a batch.
type Verdict uint8

const (
	// NoBatch: the decision is not about a batch (heartbeat, loss).
	NoBatch Verdict = iota
	// Apply: route the batch's events.
	Apply
	// Duplicate: seq at or below the last applied; ignore.
	Duplicate
	// Dropped: the epoch is being resynced (or this batch opened the gap);
	// count it, apply nothing.
	Dropped
	// Stale: a batch of an epoch that has ended; ignore (it is a sign of
	// life, nothing more).
	Stale
)

var verdictNames = [...]string{"none", "apply", "duplicate", "dropped", "stale"}

func (v Verdict) String() string { return verdictNames[v] }

// ResyncOrder is a P.E.resync to publish.
type ResyncOrder struct {
	Epoch         string
	Expected, Got uint64
	Reason        string
	Repeat        bool // a repeat of an earlier order for this epoch
}

// Decision is the outcome of one input.
type Decision struct {
	Verdict Verdict
	// Reset names the epoch that just ended (PROTOCOL.md: a new epoch is an
	// engine reset): release its requests with engine_reset before anything
	// else. Empty when no epoch ended.
	Reset string
	// Resync, when set, is to be published now.
	Resync *ResyncOrder
}

// NewSequencer starts an engine's session at now (its register). lease is
// the engine lease (PROTOCOL.md "Engine liveness"); resyncs repeat at most
// once per lease/4.
func NewSequencer(now time.Time, lease time.Duration) *Sequencer {
	return &Sequencer{lease: lease, repeat: lease / 4, lastSign: now}
}

// Inherit takes in the epochs the engine's earlier actor knew, newest
// first (its live one, then those that ended), before any epoch is live
// here. A late batch or heartbeat of one of them that arrives after this
// Sequencer began a new epoch is then Stale, as it would have been there,
// not a new epoch ending the live one: nothing would resync the engine's
// live epoch after that (the order names the late one). The first of them
// may still go on here (an engine need not begin a new epoch at a
// register); it ends once another epoch begins.
func (s *Sequencer) Inherit(recent []string) {
	if s.live || len(recent) == 0 {
		return
	}
	s.heir = recent[0]
	copy(s.ended[:], recent[1:])
}

// Epoch is the live epoch ("" before the first batch).
func (s *Sequencer) Epoch() string { return s.epoch }

// Applied is the last batch seq applied in the live epoch.
func (s *Sequencer) Applied() uint64 { return s.applied }

// Resyncing reports whether the live epoch is waiting for a new one.
func (s *Sequencer) Resyncing() bool { return s.resyncing }

// ResyncReason is the reason of the live epoch's resync ("" when none).
func (s *Sequencer) ResyncReason() string { return s.reason }

// Batch decides what to do with batch (epoch, seq) arriving at now.
//
//   - A batch of one of the last epochs that ended is Stale: ignored.
//   - A batch of another epoch starts that epoch (Reset names the old one);
//     its first batch must have seq 1, else it is a gap (seq 0 included:
//     an engine counting from 0 would otherwise lose its first batch).
//   - In the live epoch: seq ≤ applied is a duplicate; applied+1 is applied;
//     anything beyond is a gap (expected applied+1, got seq).
//   - A gap publishes a resync; later batches of the epoch are dropped, and
//     the resync is repeated at most once per lease/4 while they arrive.
func (s *Sequencer) Batch(now time.Time, epoch string, seq uint64) Decision {
	s.lastSign = now
	var d Decision
	other := s.other(epoch)
	if other && s.hasEnded(epoch) { // the live epoch never has: no scan per batch
		d.Verdict = Stale
		return d
	}
	gap := messages.ResyncGap
	if other {
		gap = s.beginGap()
		d.Reset = s.begin(epoch)
	}
	switch {
	case s.resyncing:
		d.Verdict = Dropped
		d.Resync = s.repeatResync(now)
	case seq <= s.applied && s.applied > 0:
		d.Verdict = Duplicate
	case seq == s.applied+1:
		d.Verdict = Apply
		s.applied = seq
	default:
		d.Verdict = Dropped
		d.Resync = s.startResync(now, s.applied+1, seq, gap)
	}
	return d
}

// Heartbeat takes P.E.heartbeat {epoch, seq} at now: the engine is alive,
// and seq is the last batch it published in epoch. A seq beyond what was
// applied is a lost tail (a gap). A heartbeat of an epoch the node has not
// seen with seq > 0 means that epoch's batches were all lost: the epoch
// begins here, already a gap (expected 1). A heartbeat with seq 0 changes
// nothing but liveness, as does a heartbeat of an epoch that has ended.
func (s *Sequencer) Heartbeat(now time.Time, epoch string, seq uint64) Decision {
	s.lastSign = now
	var d Decision
	gap := messages.ResyncGap
	if epoch != s.epoch || !s.live {
		if seq == 0 || s.hasEnded(epoch) {
			return d
		}
		gap = s.beginGap()
		d.Reset = s.begin(epoch)
	}
	switch {
	case s.resyncing:
		d.Resync = s.repeatResync(now)
	case seq > s.applied:
		d.Resync = s.startResync(now, s.applied+1, seq, gap)
	}
	return d
}

// beginGap is the reason of a gap the epoch now beginning opens with: that
// of the last loss told since an epoch began (lostNext), else gap.
func (s *Sequencer) beginGap() string {
	if s.lostNext != "" {
		return s.lostNext
	}
	return messages.ResyncGap
}

// Lost reports that batches of the live epoch may have been lost without the
// node seeing their seq: its own NATS reconnect, or its inbound queue
// overflowing. With a live epoch it starts a resync (got 0: unknown); an
// epoch already resyncing repeats its resync subject to the rate limit.
// With none live yet (a new engine actor) it decides nothing. Either way a
// gap the next epoch begins with, before any batch is applied, is resynced
// with reason (that epoch's first batch may be the one lost).
func (s *Sequencer) Lost(now time.Time, reason string) Decision {
	var d Decision
	s.lostNext = reason
	switch {
	case !s.live:
	case s.resyncing:
		d.Resync = s.repeatResync(now)
	default:
		d.Resync = s.startResync(now, s.applied+1, 0, reason)
	}
	return d
}

// Begins reports whether a batch of epoch would begin it (a new epoch, not
// one that ended).
func (s *Sequencer) Begins(epoch string) bool {
	return s.other(epoch) && !s.hasEnded(epoch)
}

// other reports whether epoch is not the live one.
func (s *Sequencer) other(epoch string) bool { return !s.live || epoch != s.epoch }

// BeginLost begins epoch at its batch seq already being resynced, nothing
// of it applied (expected 1, got seq): the batch cannot be applied (the
// engine actor's stillborn epoch: taken before a NATS lapse ended), and the
// epoch's batches are dropped until the engine starts another.
func (s *Sequencer) BeginLost(now time.Time, epoch string, seq uint64, reason string) Decision {
	s.lastSign = now
	d := Decision{Verdict: Dropped, Reset: s.begin(epoch)}
	d.Resync = s.startResync(now, 1, seq, reason)
	return d
}

// Silent is how long the engine has shown no sign of life at now.
func (s *Sequencer) Silent(now time.Time) time.Duration { return now.Sub(s.lastSign) }

// Order is the live epoch's resync order now, not rate limited, as a first
// order (nil when the epoch is not being resynced): for an order held back
// and owed (the engine actor holds a lapse's order until NATS answers).
func (s *Sequencer) Order(now time.Time) *ResyncOrder {
	if !s.resyncing {
		return nil
	}
	s.lastResync = now
	return &ResyncOrder{Epoch: s.epoch, Expected: s.expected, Got: s.got, Reason: s.reason}
}

// Touch records a sign of life other than a batch or heartbeat handled (a
// register, or a message the node dropped) that came at at. It never moves
// the last sign of life back: a dropped message is told late, and a batch or
// heartbeat handled meanwhile may be younger.
func (s *Sequencer) Touch(at time.Time) {
	if at.After(s.lastSign) {
		s.lastSign = at
	}
}

// Expired reports whether the engine has shown no sign of life for a lease.
func (s *Sequencer) Expired(now time.Time) bool {
	return s.lease > 0 && now.Sub(s.lastSign) >= s.lease
}

// begin makes epoch the live one and returns the epoch it ends ("" if none).
func (s *Sequencer) begin(epoch string) string {
	old := ""
	ended := s.ended
	if s.live {
		old = s.epoch
		copy(ended[1:], ended[:])
		ended[0] = old
	} else if s.heir != "" && s.heir != epoch {
		copy(ended[1:], ended[:]) // the earlier actor's live epoch ends here: no reset, its actor had them
		ended[0] = s.heir
	}
	*s = Sequencer{epoch: epoch, live: true, repeat: s.repeat, lease: s.lease, lastSign: s.lastSign, ended: ended}
	return old
}

// hasEnded reports whether epoch is one of the epochs that ended last.
func (s *Sequencer) hasEnded(epoch string) bool {
	for _, e := range s.ended {
		if e != "" && e == epoch {
			return true
		}
	}
	return false
}

func (s *Sequencer) startResync(now time.Time, expected, got uint64, reason string) *ResyncOrder {
	s.resyncing, s.expected, s.got, s.reason, s.lastResync = true, expected, got, reason, now
	return &ResyncOrder{Epoch: s.epoch, Expected: expected, Got: got, Reason: reason}
}

// repeatResync repeats the epoch's resync if lease/4 has passed since the
// last one, so a lost resync cannot leave the engine talking to a wall.
func (s *Sequencer) repeatResync(now time.Time) *ResyncOrder {
	if now.Sub(s.lastResync) < s.repeat {
		return nil
	}
	s.lastResync = now
	return &ResyncOrder{Epoch: s.epoch, Expected: s.expected, Got: s.got, Reason: s.reason, Repeat: true}
}
