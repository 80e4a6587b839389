package sched

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

// seqStep is one input to a Sequencer: a batch, a heartbeat or a loss, at
// an offset from the start.
type seqStep struct {
	at     time.Duration
	kind   string // batch, heartbeat, lost
	epoch  string
	seq    uint64
	reason string // lost
	want   Decision
}

func batch(at time.Duration, epoch string, seq uint64, want Decision) seqStep {
	return seqStep{at: at, kind: "batch", epoch: epoch, seq: seq, want: want}
}

func heartbeat(at time.Duration, epoch string, seq uint64, want Decision) seqStep {
	return seqStep{at: at, kind: "heartbeat", epoch: epoch, seq: seq, want: want}
}

func lost(at time.Duration, reason string, want Decision) seqStep {
	return seqStep{at: at, kind: "lost", reason: reason, want: want}
}

func order(epoch string, expected, got uint64, reason string, repeat bool) *ResyncOrder {
	return &ResyncOrder{Epoch: epoch, Expected: expected, Got: got, Reason: reason, Repeat: repeat}
}

var (
	apply   = Decision{Verdict: Apply}
	dup     = Decision{Verdict: Duplicate}
	dropped = Decision{Verdict: Dropped}
	nothing = Decision{}
)

const testLease = 400 * time.Millisecond // resyncs repeat at most every 100ms

func TestSequencerRules(t *testing.T) {
	gap := messages.ResyncGap
	for _, tc := range []struct {
		name  string
		steps []seqStep
	}{
		{"EventBatch: +1 per batch applies in order", []seqStep{
			batch(0, "a", 1, apply), batch(0, "a", 2, apply), batch(0, "a", 3, apply)}},
		{"EventBatch: seq at or below the last applied is a duplicate", []seqStep{
			batch(0, "a", 1, apply), batch(0, "a", 2, apply), batch(0, "a", 2, dup), batch(0, "a", 1, dup),
			batch(0, "a", 3, apply)}},
		{"Delivery: a seq jump is a gap, never applied", []seqStep{
			batch(0, "a", 1, apply),
			batch(0, "a", 3, Decision{Verdict: Dropped, Resync: order("a", 2, 3, gap, false)})}},
		{"Delivery: after a gap, later batches of the epoch are dropped (even the missing one)", []seqStep{
			batch(0, "a", 1, apply),
			batch(0, "a", 3, Decision{Verdict: Dropped, Resync: order("a", 2, 3, gap, false)}),
			batch(time.Millisecond, "a", 2, dropped), batch(2*time.Millisecond, "a", 4, dropped)}},
		{"Delivery: the resync repeats at most once per lease/4 while batches arrive", []seqStep{
			batch(0, "a", 1, apply),
			batch(0, "a", 5, Decision{Verdict: Dropped, Resync: order("a", 2, 5, gap, false)}),
			batch(99*time.Millisecond, "a", 6, dropped),
			batch(100*time.Millisecond, "a", 7, Decision{Verdict: Dropped, Resync: order("a", 2, 5, gap, true)}),
			batch(150*time.Millisecond, "a", 8, dropped),
			heartbeat(200*time.Millisecond, "a", 8, Decision{Resync: order("a", 2, 5, gap, true)}),
			heartbeat(201*time.Millisecond, "a", 8, nothing)}},
		{"Delivery: a new epoch ends the resync and resets the old epoch", []seqStep{
			batch(0, "a", 1, apply),
			batch(0, "a", 3, Decision{Verdict: Dropped, Resync: order("a", 2, 3, gap, false)}),
			batch(0, "b", 1, Decision{Verdict: Apply, Reset: "a"}), batch(0, "b", 2, apply)}},
		{"Delivery (v2): the first batch of an epoch must have seq 1", []seqStep{
			batch(0, "a", 7, Decision{Verdict: Dropped, Resync: order("a", 1, 7, gap, false)}),
			batch(0, "a", 8, dropped)}},
		{"Delivery (v2): the first batch of a new epoch must have seq 1 too", []seqStep{
			batch(0, "a", 1, apply),
			batch(0, "b", 2, Decision{Verdict: Dropped, Reset: "a", Resync: order("b", 1, 2, gap, false)})}},
		{"Delivery (v2): seq 0 is never a first batch", []seqStep{
			batch(0, "a", 0, Decision{Verdict: Dropped, Resync: order("a", 1, 0, gap, false)})}},
		{"EventBatch: seq 0 after the first batch is a duplicate", []seqStep{
			batch(0, "a", 1, apply), batch(0, "a", 0, dup)}},
		{"Sessions: a heartbeat seq equal to applied is in sync", []seqStep{
			batch(0, "a", 1, apply), batch(0, "a", 2, apply), heartbeat(0, "a", 2, nothing),
			heartbeat(0, "a", 1, nothing)}},
		{"Delivery: a heartbeat seq beyond applied is a lost tail", []seqStep{
			batch(0, "a", 1, apply),
			heartbeat(0, "a", 3, Decision{Resync: order("a", 2, 3, gap, false)}),
			batch(0, "a", 2, dropped)}},
		{"Delivery: a heartbeat of an unseen epoch with seq>0 lost that epoch's first batches", []seqStep{
			batch(0, "a", 1, apply),
			heartbeat(0, "b", 2, Decision{Reset: "a", Resync: order("b", 1, 2, gap, false)}),
			batch(0, "b", 3, dropped),
			batch(0, "c", 1, Decision{Verdict: Apply, Reset: "b"})}},
		{"Sessions: a late heartbeat of the epoch that just ended changes nothing", []seqStep{
			batch(0, "a", 1, apply), batch(0, "a", 2, apply),
			batch(0, "b", 1, Decision{Verdict: Apply, Reset: "a"}),
			heartbeat(0, "a", 2, nothing), // sent before b's first batch, arriving after it
			heartbeat(0, "a", 3, nothing), // even one beyond what a applied: a is over
			batch(0, "b", 2, apply), heartbeat(0, "b", 2, nothing)}},
		{"Sessions: a late batch of an ended epoch is stale, not a new epoch", []seqStep{
			batch(0, "a", 1, apply),
			batch(0, "b", 1, Decision{Verdict: Apply, Reset: "a"}),
			batch(0, "a", 2, Decision{Verdict: Stale}),
			batch(0, "b", 2, apply)}},
		{"Sessions: the last four ended epochs are remembered", []seqStep{
			batch(0, "a", 1, apply),
			batch(0, "b", 1, Decision{Verdict: Apply, Reset: "a"}),
			batch(0, "c", 1, Decision{Verdict: Apply, Reset: "b"}),
			batch(0, "d", 1, Decision{Verdict: Apply, Reset: "c"}),
			batch(0, "e", 1, Decision{Verdict: Apply, Reset: "d"}),
			heartbeat(0, "a", 5, nothing), heartbeat(0, "d", 5, nothing),
			batch(0, "f", 1, Decision{Verdict: Apply, Reset: "e"}),
			// a has been forgotten: an unseen epoch again
			heartbeat(0, "a", 5, Decision{Reset: "f", Resync: order("a", 1, 5, gap, false)})}},
		{"Sessions: a heartbeat with seq 0 of a new epoch changes nothing", []seqStep{
			batch(0, "a", 1, apply), heartbeat(0, "b", 0, nothing), batch(0, "a", 2, apply)}},
		{"Delivery: the node's own reconnect resyncs a live epoch", []seqStep{
			lost(0, messages.ResyncReconnect, nothing), // no epoch yet: nothing to resync
			batch(0, "a", 1, apply), batch(0, "a", 2, apply),
			lost(0, messages.ResyncReconnect, Decision{Resync: order("a", 3, 0, messages.ResyncReconnect, false)}),
			batch(0, "a", 3, dropped),
			batch(0, "b", 1, Decision{Verdict: Apply, Reset: "a"})}},
		{"Delivery: an inbound overflow resyncs a live epoch; a second loss is rate limited", []seqStep{
			batch(0, "a", 1, apply),
			lost(0, messages.ResyncOverflow, Decision{Resync: order("a", 2, 0, messages.ResyncOverflow, false)}),
			lost(time.Millisecond, messages.ResyncOverflow, nothing),
			lost(100*time.Millisecond, messages.ResyncOverflow,
				Decision{Resync: order("a", 2, 0, messages.ResyncOverflow, true)})}},
		{"Delivery: a loss before any epoch names the gap the first epoch begins with", []seqStep{
			lost(0, messages.ResyncOverflow, nothing), // a new actor: its engine's first batch went
			batch(0, "a", 2, Decision{Verdict: Dropped, Resync: order("a", 1, 2, messages.ResyncOverflow, false)}),
			batch(0, "b", 3, Decision{Verdict: Dropped, Reset: "a", Resync: order("b", 1, 3, gap, false)})}},
		{"Delivery: a loss before any epoch names a heartbeat's gap too", []seqStep{
			lost(0, messages.ResyncOverflow, nothing),
			heartbeat(0, "a", 0, nothing), // begins nothing
			heartbeat(0, "a", 1, Decision{Resync: order("a", 1, 1, messages.ResyncOverflow, false)})}},
		// The engine answered a's overflow resync with b, whose seq 1 was
		// dropped at the full intake; the Lost for it came while a was live.
		{"Delivery: a loss while an epoch is live names the gap the next epoch begins with", []seqStep{
			batch(0, "a", 1, apply),
			lost(0, messages.ResyncOverflow, Decision{Resync: order("a", 2, 0, messages.ResyncOverflow, false)}),
			batch(0, "b", 2, Decision{Verdict: Dropped, Reset: "a", Resync: order("b", 1, 2, messages.ResyncOverflow, false)})}},
		{"Delivery: the epoch after the one that began past a loss begins with a plain gap", []seqStep{
			batch(0, "a", 1, apply),
			lost(0, messages.ResyncOverflow, Decision{Resync: order("a", 2, 0, messages.ResyncOverflow, false)}),
			batch(0, "b", 1, Decision{Verdict: Apply, Reset: "a"}),
			batch(0, "c", 2, Decision{Verdict: Dropped, Reset: "b", Resync: order("c", 1, 2, gap, false)})}},
		{"Delivery: a loss before an epoch that begins at seq 1 is forgotten", []seqStep{
			lost(0, messages.ResyncOverflow, nothing),
			batch(0, "a", 1, apply), batch(0, "a", 3, Decision{Verdict: Dropped, Resync: order("a", 2, 3, gap, false)})}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			start := time.Unix(1000, 0)
			s := NewSequencer(start, testLease)
			for i, st := range tc.steps {
				now := start.Add(st.at)
				var got Decision
				switch st.kind {
				case "batch":
					got = s.Batch(now, st.epoch, st.seq)
				case "heartbeat":
					got = s.Heartbeat(now, st.epoch, st.seq)
				case "lost":
					got = s.Lost(now, st.reason)
				}
				require.Equal(t, st.want, got, "step %d: %s %s/%d", i, st.kind, st.epoch, st.seq)
			}
		})
	}
}

func TestSequencerAppliedAndEpoch(t *testing.T) {
	s := NewSequencer(time.Unix(0, 0), testLease)
	require.Equal(t, "", s.Epoch())
	s.Batch(time.Unix(0, 0), "a", 1)
	s.Batch(time.Unix(0, 0), "a", 2)
	require.Equal(t, "a", s.Epoch())
	require.Equal(t, uint64(2), s.Applied())
	require.False(t, s.Resyncing())
	s.Batch(time.Unix(0, 0), "a", 9)
	require.True(t, s.Resyncing())
	require.Equal(t, uint64(2), s.Applied(), "a gap applies nothing")
	s.Batch(time.Unix(0, 0), "b", 1)
	require.Equal(t, uint64(1), s.Applied())
	require.False(t, s.Resyncing())
}

// Sessions, "Engine liveness": any batch or heartbeat is a sign of life; no
// sign for a lease expires the engine.
func TestSequencerExpiry(t *testing.T) {
	start := time.Unix(1000, 0)
	s := NewSequencer(start, testLease)
	require.False(t, s.Expired(start.Add(testLease-time.Nanosecond)))
	require.True(t, s.Expired(start.Add(testLease)))
	s.Batch(start.Add(testLease), "a", 1)
	require.False(t, s.Expired(start.Add(2*testLease-time.Nanosecond)))
	s.Heartbeat(start.Add(2*testLease-time.Nanosecond), "a", 1)
	require.False(t, s.Expired(start.Add(3*testLease-2*time.Nanosecond)))
	require.True(t, s.Expired(start.Add(3*testLease)))
	s.Touch(start.Add(3 * testLease))
	require.False(t, s.Expired(start.Add(3*testLease)))
	s.Touch(start.Add(2 * testLease)) // an older sign of life told late (dropped at intake): no move back
	require.False(t, s.Expired(start.Add(4*testLease-time.Nanosecond)))
	// A dropped batch (resyncing) is still a sign of life.
	s.Batch(start.Add(4*testLease), "a", 5)
	s.Batch(start.Add(5*testLease-time.Nanosecond), "a", 6)
	require.False(t, s.Expired(start.Add(6*testLease-2*time.Nanosecond)))
}

// Whatever arrives, the sequencer never applies a seq other than applied+1
// and never applies anything while resyncing (a naive model of the rules).
func FuzzSequencerNeverAppliesAGap(f *testing.F) {
	f.Add([]byte{1, 2, 3, 5, 4, 0x81, 1})
	f.Add([]byte{7, 0x41, 2, 0x82, 1, 2})
	f.Fuzz(func(t *testing.T, in []byte) {
		now := time.Unix(0, 0)
		s := NewSequencer(now, testLease)
		epochs := []string{"a", "b", "c", "d"}
		for _, b := range in {
			now = now.Add(7 * time.Millisecond)
			epoch, seq := epochs[(b>>6)&3], uint64(b&0x1f)
			beforeEpoch, beforeApplied, beforeResync := s.Epoch(), s.Applied(), s.Resyncing()
			var d Decision
			if b&0x20 != 0 {
				d = s.Heartbeat(now, epoch, seq)
				require.NotEqual(t, Apply, d.Verdict)
				continue
			}
			d = s.Batch(now, epoch, seq)
			if d.Verdict != Apply {
				continue
			}
			if epoch == beforeEpoch {
				require.False(t, beforeResync, "applied while resyncing")
				require.Equal(t, beforeApplied+1, seq)
			} else {
				require.Equal(t, uint64(1), seq, "a new epoch applied from seq %d", seq)
			}
		}
	})
}
