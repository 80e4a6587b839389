package cluster

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/cluster/ownership"
	"github.com/kvactors/kvactors/internal/testkit"
)

// What a keep-alive sees at a heal: the server whose routes came back
// answers reads from a replica that has not caught up, and, deposed but not
// yet told, refuses writes of a key it holds an uncommitted write of as in
// process (10164), while the new leader commits the same writes; whichever
// reply comes first is the one the writer gets. Observed in
// node.TestAnOwnerCutOffWithItsStreamLeaderIsFencedBeforeItsStandbyClaims.

// ownerAfterBWithALostReply is gpu-a holding e1 after gpu-b held and
// released it, with a's keep-alive write landed at landed and its reply
// lost; old is b's record, what a replica that lags still shows.
func ownerAfterBWithALostReply(t *testing.T) (a *Owners, old jetstream.KeyValueEntry, landed uint64) {
	t.Helper()
	_, nc := testkit.NATS(t)
	a = openOwnersLease(t, nc, "gpu-a", "", 1, staleLease)
	b := openOwnersLease(t, nc, "gpu-b", "", 1, staleLease)
	ctx := ctxT(t)
	mustServe(t, b, "e1", Request{Register: true, Local: true})
	old, err := b.kv.Get(ctx, "e1")
	require.NoError(t, err)
	require.NoError(t, b.Release(ctx, "e1"))
	mustServe(t, a, "e1", Request{Register: true, Local: true})
	landed, err = a.kv.Update(ctx, "e1", ownership.EncodeRecord(ownership.Record{Identity: a.me, LeaseMS: staleLease.Milliseconds(),
		Renewed: time.Now().UnixMilli()}), a.Revision("e1"))
	require.NoError(t, err)
	return a, old, landed
}

// At a heal, a keep-alive's write may land while its reply says otherwise
// (the deposed stream leader refuses it as in process), so its retry is
// refused past its own write. The reads that should show that write may
// come from a replica that lags, still showing the previous owner's record,
// below the claim's revision: not the write past it, so no fence. The
// owner reads on, finds its own write and renews.
func TestAKeepAliveIsNotFencedByALaggingReadOfThePreviousOwner(t *testing.T) {
	a, old, landed := ownerAfterBWithALostReply(t)
	ctx := ctxT(t)

	real := a.kv
	lag := &staleGetKV{KeyValue: real, old: old}
	lag.stale.Store(3) // the keep-alive's check, then two reads past its revision
	a.kv = lag
	rev, err := a.KeepAlive(ctx, "e1")
	require.NoError(t, err, "a lagging read of b's record fenced a's live claim")
	require.Greater(t, rev, landed, "renewed on its own landed write")
	require.Negative(t, lag.stale.Load(), "every stale read was served")
	require.True(t, a.Serving("e1", time.Now()))
	require.Zero(t, testutil.ToFloat64(a.metrics.Fenced))
	a.kv = real
}

// refusal is a compare-and-set refused as nats.go reports it: the API
// error wrapped with ErrKeyRevisionMismatch (10164: "in process"; 10071:
// "wrong last sequence: N").
func refusal(code jetstream.ErrorCode, desc string) error {
	return fmt.Errorf("%w: %w", &jetstream.APIError{Code: 400, ErrorCode: code, Description: desc}, jetstream.ErrKeyRevisionMismatch)
}

// refusedButLandedKV commits every Update and then answers it as the
// deposed leader would have first: another write in process (10164).
// sentBy is when the call that landed at each revision began: no earlier
// than the claim's send time of that write.
type refusedButLandedKV struct {
	jetstream.KeyValue
	landed atomic.Int64
	sentBy map[uint64]time.Time
}

func (k *refusedButLandedKV) Update(ctx context.Context, key string, value []byte, rev uint64) (uint64, error) {
	called := time.Now()
	n, err := k.KeyValue.Update(ctx, key, value, rev)
	if err != nil {
		return n, err
	}
	if k.sentBy == nil {
		k.sentBy = map[uint64]time.Time{}
	}
	k.sentBy[n] = called
	k.landed.Add(1)
	return 0, refusal(jetstream.JSErrCodeStreamWrongLastSequenceConstant, "wrong last sequence")
}

// Every keep-alive write lands, and every reply says "in process": the
// retries are refused on the node's own writes, which the reads then show.
// Each one found is a renewal, sent no earlier than the first write not yet
// known to have landed, so the claim stays served and moves to the newest
// revision found. Before, the revision and the lease stayed where the last
// acknowledged write left them, and the gate shut a lease later on writes
// that had all landed.
func TestWritesThatLandUnacknowledgedRenewTheClaim(t *testing.T) {
	a, _, rev := ownerOfE1(t)
	ctx := ctxT(t)
	real := a.kv
	kv := &refusedButLandedKV{KeyValue: real}
	a.kv = kv
	before := time.Now()
	_, err := a.KeepAlive(ctx, "e1")
	require.Error(t, err, "the last write's reply too said in process")
	require.NotErrorIs(t, err, ErrFenced)
	require.GreaterOrEqual(t, kv.landed.Load(), int64(2))
	require.Greater(t, a.Revision("e1"), rev, "renewed on a write found landed")
	a.mu.Lock()
	renewed := a.mine["e1"].renewed
	a.mu.Unlock()
	require.False(t, renewed.Before(before), "renewed as of a write of this keep-alive, not earlier")
	require.False(t, renewed.After(kv.sentBy[a.Revision("e1")]),
		"renewed as of a send no later than the landed write's: the local lease must end first")
	require.True(t, a.Serving("e1", time.Now()))
	require.Zero(t, testutil.ToFloat64(a.metrics.Fenced))
	require.Equal(t, float64(kv.landed.Load()-1), testutil.ToFloat64(a.metrics.Unsettled.WithLabelValues("landed")),
		"every landed write but the last was found and counted")
	require.Equal(t, float64(kv.landed.Load()), testutil.ToFloat64(a.metrics.Unsettled.WithLabelValues("in_process")))

	a.kv = real // the deposed leader hears of the new one: the next keep-alive finds its last write and renews
	nrev, err := a.KeepAlive(ctx, "e1")
	require.NoError(t, err)
	require.Greater(t, nrev, rev+uint64(kv.landed.Load()), "past every landed write")
}

// A keep-alive refused past its revision whose reads never move past it
// (every one from the replica that lags) cannot tell its own landed write
// from another node's: no verdict. The claim stays, bounded by its local
// lease, and the next pass tries again. Before, it was fenced, and the
// engine was dropped by the node whose write had landed.
func TestARefusalNoReadExplainsIsNoFence(t *testing.T) {
	a, old, _ := ownerAfterBWithALostReply(t)
	ctx := ctxT(t)

	real := a.kv
	lag := &staleGetKV{KeyValue: real, old: old}
	lag.stale.Store(1 << 30) // it never catches up within the pass
	a.kv = lag
	pass, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	_, err := a.KeepAlive(pass, "e1")
	require.Error(t, err)
	require.False(t, errors.Is(err, ErrFenced), "fenced with no read naming another node: %v", err)
	require.Equal(t, []string{"e1"}, a.Mine(), "the claim stays")
	require.Zero(t, testutil.ToFloat64(a.metrics.Fenced))
	require.Equal(t, 1.0, testutil.ToFloat64(a.metrics.Unsettled.WithLabelValues("unexplained")))

	a.kv = real // caught up: the next pass finds its own write and renews
	_, err = a.KeepAlive(ctx, "e1")
	require.NoError(t, err)
	require.True(t, a.Serving("e1", time.Now()))
}

func TestLastSequenceReadsTheRefusalsSequence(t *testing.T) {
	for _, c := range []struct {
		err  error
		want uint64
		ok   bool
	}{
		{refusal(jetstream.JSErrCodeStreamWrongLastSequence, "wrong last sequence: 21"), 21, true},
		{refusal(jetstream.JSErrCodeStreamWrongLastSequence, "wrong last sequence: 0"), 0, true},
		{refusal(jetstream.JSErrCodeStreamWrongLastSequenceConstant, "wrong last sequence"), 0, false}, // in process: none named
		{refusal(jetstream.JSErrCodeStreamWrongLastSequence, "wrong last sequence: x"), 0, false},
		{jetstream.ErrKeyRevisionMismatch, 0, false},
		{errors.New("timeout"), 0, false},
	} {
		got, ok := lastSequence(c.err)
		require.Equal(t, c.ok, ok, "%v", c.err)
		require.Equal(t, c.want, got, "%v", c.err)
	}
}

// lostReplyKV commits the first Update and answers it as a timeout (its
// reply lost across a leader change); it passes the next one through and
// refuses the rest as in process, committing nothing.
type lostReplyKV struct {
	jetstream.KeyValue
	calls  int
	sentBy time.Time // when the lost write's call began
}

func (k *lostReplyKV) Update(ctx context.Context, key string, value []byte, rev uint64) (uint64, error) {
	k.calls++
	switch k.calls {
	case 1:
		k.sentBy = time.Now()
		if _, err := k.KeyValue.Update(ctx, key, value, rev); err != nil {
			return 0, err
		}
		return 0, context.DeadlineExceeded
	case 2:
		return k.KeyValue.Update(ctx, key, value, rev)
	}
	return 0, refusal(jetstream.JSErrCodeStreamWrongLastSequenceConstant, "wrong last sequence")
}

// A held claim's write made by a register (a claim on its own lapsed
// record, not a keep-alive) may land with its reply lost; the next
// keep-alive, refused past its revision, finds it and counts it as a
// renewal. That renewal must date from the register's write, sent before
// the keep-alive's: dated from the keep-alive's, the local lease would
// outlast the servers'. (The keep-alive's own writes are refused after, so
// the finding is what the claim holds.)
func TestAKeepAliveFindingARegistersLandedWriteDatesItFromThatWrite(t *testing.T) {
	a, _, rev := ownerOfE1(t)
	ctx := ctxT(t)
	real := a.kv
	kv := &lostReplyKV{KeyValue: real}
	a.kv = kv
	require.Error(t, a.claim(ctx, "e1", rev, false), "the register's write timed out")
	require.Equal(t, rev, a.Revision("e1"), "no reply: nothing renewed yet")

	_, err := a.KeepAlive(ctx, "e1")
	require.Error(t, err, "its own writes refused as in process")
	require.NotErrorIs(t, err, ErrFenced)
	a.mu.Lock()
	h := a.mine["e1"]
	a.mu.Unlock()
	require.Equal(t, rev+1, h.rev, "renewed on the register's landed write")
	require.False(t, h.renewed.After(kv.sentBy), "dated from the register's write (%v), not later (%v)", kv.sentBy, h.renewed)
	require.Equal(t, 1.0, testutil.ToFloat64(a.metrics.Unsettled.WithLabelValues("landed")))
	a.kv = real
}

// deposedLeaderKV refuses its next stale Updates as a stream leader
// deposed but not yet told does (its routes cut, or just back): it checks
// the expected revision against its own store, behind the write at the
// claim's revision, names that store's last sequence of the key (10071,
// below the revision) and commits nothing. Then it passes the writes
// through (told, it no longer answers them).
type deposedLeaderKV struct {
	jetstream.KeyValue
	last  uint64
	stale atomic.Int64
}

func (k *deposedLeaderKV) Update(ctx context.Context, key string, value []byte, rev uint64) (uint64, error) {
	if k.stale.Add(-1) >= 0 {
		return 0, refusal(jetstream.JSErrCodeStreamWrongLastSequence, fmt.Sprintf("wrong last sequence: %d", k.last))
	}
	return k.KeyValue.Update(ctx, key, value, rev)
}

// A refusal naming a last sequence below the claim's revision is lost
// writes only if the key is below it: a read showing the record at the
// revision (the claim's own, committed) proves the answer stale, a deposed
// stream leader's, and the write is tried again. Refused so until the tries
// run out, it fails without a fence and the claim stays; once the deposed
// leader stops answering, the keep-alive renews. Before, the reads waited
// the pass out for a write past the revision, and the claim was fenced: the
// node dropped an engine the bucket still named it for, nobody else having
// written.
func TestARefusalBelowTheClaimThatAReadRefutesIsNoFence(t *testing.T) {
	a, _, first := ownerOfE1(t)
	ctx := ctxT(t)
	rev, err := a.KeepAlive(ctx, "e1") // the deposed leader's store stops at first
	require.NoError(t, err)

	real := a.kv
	kv := &deposedLeaderKV{KeyValue: real, last: first}
	kv.stale.Store(2)
	a.kv = kv
	pass, cancel := context.WithTimeout(ctx, staleLease/4) // the node's pass
	defer cancel()
	nrev, err := a.KeepAlive(pass, "e1")
	require.NoError(t, err, "a deposed leader's stale refusal decided the claim")
	require.Greater(t, nrev, rev, "renewed once the refusals stopped")
	require.True(t, a.Serving("e1", time.Now()))
	require.Zero(t, testutil.ToFloat64(a.metrics.Fenced))
	require.Equal(t, 2.0, testutil.ToFloat64(a.metrics.Unsettled.WithLabelValues("stale")))

	kv.stale.Store(1 << 30) // it answers every try of a pass
	_, err = a.KeepAlive(ctx, "e1")
	require.Error(t, err)
	require.NotErrorIs(t, err, ErrFenced)
	require.Equal(t, []string{"e1"}, a.Mine(), "the claim stays, bounded by its local lease")
	require.Equal(t, nrev, a.Revision("e1"))
	kv.stale.Store(0)
	_, err = a.KeepAlive(ctx, "e1")
	require.NoError(t, err, "renewed at the next pass")
	a.kv = real
}

// The same refusal, but the read at the keep-alive's revision names another
// node: the bucket lost writes and issued that revision again, to another
// claim (found after keepAlive's own check, which a lagging replica
// answered). That read is no refutation: a write retried on the revision
// would overwrite the other claim. Fenced.
func TestARefusalBelowTheClaimWithItsRevisionIssuedAgainIsFenced(t *testing.T) {
	a, nc, first := ownerOfE1(t)
	ctx := ctxT(t)
	rev, err := a.KeepAlive(ctx, "e1")
	require.NoError(t, err)
	old, err := a.kv.Get(ctx, "e1")
	require.NoError(t, err)
	b := loseTheBucket(t, nc, staleLease)
	mustServe(t, b, "e1", Request{Register: true, Local: true})
	_, err = b.KeepAlive(ctx, "e1")
	require.NoError(t, err)
	require.Equal(t, rev, b.Revision("e1"), "the loss issues a's revision again, to b")

	real := a.kv
	kv := &deposedLeaderKV{KeyValue: real, last: first}
	kv.stale.Store(1 << 30)
	a.kv = &reissuedKV{deposedLeaderKV: kv, old: old}
	_, err = a.KeepAlive(ctx, "e1")
	require.ErrorIs(t, err, ErrFenced)
	require.Empty(t, a.Mine())
	require.Zero(t, testutil.ToFloat64(a.metrics.Unsettled.WithLabelValues("stale")))
	a.kv = real
}

// reissuedKV is a deposedLeaderKV whose first read of old's key (the
// keep-alive's check, from a replica that lags the loss) shows old.
type reissuedKV struct {
	*deposedLeaderKV
	old   jetstream.KeyValueEntry
	reads atomic.Int64
}

func (k *reissuedKV) Get(ctx context.Context, key string) (jetstream.KeyValueEntry, error) {
	if key == k.old.Key() && k.reads.Add(1) == 1 {
		return k.old, nil
	}
	return k.deposedLeaderKV.Get(ctx, key)
}
