package cluster

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/cluster/ownership"
	"github.com/kvactors/kvactors/internal/testkit"
)

// staleLease is the tests' lease: long enough that nothing lapses unless
// a test says so.
const staleLease = 5 * time.Second

// ownerOfE1 is gpu-a on a NATS of its own, holding a claim on e1 at rev.
func ownerOfE1(t *testing.T) (a *Owners, nc *nats.Conn, rev uint64) {
	t.Helper()
	_, nc = testkit.NATS(t)
	a = openOwnersLease(t, nc, "gpu-a", "", 1, staleLease)
	mustServe(t, a, "e1", Request{Register: true, Local: true})
	return a, nc, a.Revision("e1")
}

// loseTheBucket simulates a loss of the bucket's writes at its extreme (the
// servers' unsynced tail, after a power loss): the bucket is deleted, and
// gpu-b, opening it with lease, creates it empty; revisions start again
// from 1.
func loseTheBucket(t *testing.T, nc *nats.Conn, lease time.Duration) (b *Owners) {
	t.Helper()
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	require.NoError(t, js.DeleteKeyValue(ctxT(t), "kvactors_owners"))
	return openOwnersLease(t, nc, "gpu-b", "", 1, lease)
}

// staleGetKV answers Get as a direct get served by a replica that lags the
// quorum (CLUSTER.md "Reads may lag"): its next stale reads of old's key
// show old, then the bucket's own (a server whose routes came back catching
// up); a key it has not yet seen the first write of (missing) is not found.
type staleGetKV struct {
	jetstream.KeyValue
	old     jetstream.KeyValueEntry
	stale   atomic.Int64
	missing string
}

func (k *staleGetKV) Get(ctx context.Context, key string) (jetstream.KeyValueEntry, error) {
	if k.old != nil && key == k.old.Key() && k.stale.Add(-1) >= 0 {
		return k.old, nil
	}
	if key == k.missing {
		return nil, jetstream.ErrKeyNotFound
	}
	return k.KeyValue.Get(ctx, key)
}

// Nothing is decided on a read alone (CLUSTER.md): an owner whose read of
// its engine's record is served by a lagging replica (still showing the
// node that held it before) keeps its claim, serves and renews it; the
// keep-alive's compare-and-set is what would fence it. A read past its own
// write that names another node does end it.
func TestAStaleReadDoesNotMakeTheOwnerDropItsClaim(t *testing.T) {
	_, nc := testkit.NATS(t)
	a := openOwnersLease(t, nc, "gpu-a", "", 1, staleLease)
	b := openOwnersLease(t, nc, "gpu-b", "", 1, staleLease)
	ctx := ctxT(t)

	// b held e1, then released it; a claimed it.
	mustServe(t, b, "e1", Request{Register: true, Local: true})
	old, err := b.kv.Get(ctx, "e1") // b's record: what a lagging replica may still serve
	require.NoError(t, err)
	require.NoError(t, b.Release(ctx, "e1"))
	mustServe(t, a, "e1", Request{Register: true, Local: true})

	// The engine registers again (a resync); a's read is a lagging replica's.
	real := a.kv
	lag := &staleGetKV{KeyValue: real, old: old}
	lag.stale.Store(1 << 30) // it does not catch up meanwhile
	a.kv = lag
	d, err := a.Resolve(ctx, "e1", Request{Register: true, Local: true})
	require.NoError(t, err)
	require.Equal(t, ownership.Serve, d.Action, "a read older than a's own write decides nothing")
	cur, err := b.Get(ctx, "e1")
	require.NoError(t, err)
	require.Equal(t, "gpu-a", cur.Node, "the bucket still names a")
	require.True(t, a.Serving("e1", time.Now()), "a keeps its live claim over a stale read")
	_, err = a.KeepAlive(ctx, "e1")
	require.NoError(t, err, "and renews it")
	a.kv = real

	// Another node's record past a's own write (here written over it) is
	// proof: a's next read of it ends a's claim.
	_, err = real.Put(ctx, "e1", ownership.EncodeRecord(ownership.Record{Identity: b.me, LeaseMS: staleLease.Milliseconds(),
		Renewed: time.Now().UnixMilli()}))
	require.NoError(t, err)
	_, err = a.Resolve(ctx, "e1", Request{Register: true, Local: true})
	require.NoError(t, err)
	require.False(t, a.Serving("e1", time.Now()), "a read past its write names b")
}

// A read that shows no record at all (a replica that has not seen the
// key's first write) while the owner holds a live claim is no proof either:
// the owner confirms its claim with a keep-alive (a create would fail on
// the key that exists and leave the owner waiting a lease for a read that
// shows it, then drop the claim) and serves the engine's messages.
func TestAReadShowingNoRecordDoesNotMakeTheOwnerDropItsClaim(t *testing.T) {
	a, _, rev := ownerOfE1(t)
	ctx := ctxT(t)

	real := a.kv
	a.kv = &staleGetKV{KeyValue: real, missing: "e1"}
	for _, req := range []Request{{Register: true, Local: true}, {}} {
		d, err := a.Resolve(ctx, "e1", req)
		require.NoError(t, err)
		require.Equal(t, ownership.Serve, d.Action, "request %+v", req)
		require.Greater(t, a.Revision("e1"), rev, "confirmed by a compare-and-set on the claim")
		rev = a.Revision("e1")
	}
	require.True(t, a.Serving("e1", time.Now()))
	require.Zero(t, testutil.ToFloat64(a.metrics.Fenced), "nothing fenced")
	a.kv = real
	cur, err := a.Get(ctx, "e1")
	require.NoError(t, err)
	require.Equal(t, rev, cur.Revision)
	require.Equal(t, "gpu-a", cur.Node)
}

// A bucket that lost writes issues revisions again: another node's claim
// made after the loss can sit at a revision below the one an owner still
// holds, and look like a read lagging that owner's write. The owner does
// not answer on its own write then: the keep-alive that confirms it is
// fenced, and the engine's register is decided on the other node's record.
// The fence waits out a's lease of reads for one past its revision (a
// record below it may be a lagging replica's), so a's lease here is the
// shortest, while the bucket b makes again keeps records for staleLease:
// with one lease for both, b's record, not renewed during a's wait, could
// lapse first and a would claim the engine afresh.
func TestARecordBelowTheOwnersRevisionFromALossIsNotServedOver(t *testing.T) {
	_, nc := testkit.NATS(t)
	a := openOwnersLease(t, nc, "gpu-a", "", 1, time.Second)
	ctx := ctxT(t)
	for _, e := range []string{"x1", "x2", "e1"} { // e1's revision above 1
		mustServe(t, a, e, Request{Register: true, Local: true})
	}
	revA := a.Revision("e1")

	b := loseTheBucket(t, nc, staleLease)
	mustServe(t, b, "e1", Request{Register: true, Local: true})
	require.Less(t, b.Revision("e1"), revA)

	d, err := a.Resolve(ctx, "e1", Request{Register: true, Local: true})
	require.NoError(t, err)
	require.Equal(t, ownership.Ignore, d.Action, "a does not answer over b's claim")
	require.Equal(t, "gpu-b", d.Owner)
	_, err = b.KeepAlive(ctx, "e1")
	require.NoError(t, err, "b's claim stands")
	now := time.Now()
	require.False(t, a.Serving("e1", now), "a's claim is fenced")
	require.True(t, b.Serving("e1", now))
	require.Equal(t, 1.0, testutil.ToFloat64(a.metrics.Fenced))
	cur, err := b.Get(ctx, "e1")
	require.NoError(t, err)
	require.Equal(t, "gpu-b", cur.Node, "b's record stands")
	// The node learns of the fence as of one a keep-alive finds: it drops
	// the engine it served (x1 and x2, lost with the bucket, are fenced by
	// this pass's keep-alives).
	lost, err := a.KeepAliveAll(ctx)
	require.NoError(t, err)
	require.Equal(t, []string{"e1", "x1", "x2"}, lost)
	lost, err = a.KeepAliveAll(ctx)
	require.NoError(t, err)
	require.Empty(t, lost, "reported once")
}

// noRespondersKV answers every Get as when no replica serves direct gets
// (a leader election), and counts them.
type noRespondersKV struct {
	jetstream.KeyValue
	gets atomic.Int64
}

func (k *noRespondersKV) Get(context.Context, string) (jetstream.KeyValueEntry, error) {
	k.gets.Add(1)
	return nil, nats.ErrNoResponders
}

// A keep-alive reads the record before its compare-and-set (the check for a
// revision issued again): while no replica answers reads, it retries the
// read for lease/8, not for up to a lease as a register's read does, then
// renews.
func TestAKeepAliveDoesNotWaitOutReadsWithoutResponders(t *testing.T) {
	a, _, rev := ownerOfE1(t)
	ctx := ctxT(t)

	real := a.kv
	kv := &noRespondersKV{KeyValue: real}
	a.kv = kv
	nrev, err := a.KeepAlive(ctx, "e1")
	require.NoError(t, err)
	require.Greater(t, nrev, rev, "renewed")
	// Read again every 20 ms for lease/8 (about 32 reads), not a lease
	// (about 250).
	require.LessOrEqual(t, kv.gets.Load(), int64(staleLease/8/(20*time.Millisecond))+2, "reads")
	require.Greater(t, kv.gets.Load(), int64(1), "retried")
	a.kv = real
}

// A pass of keep-alives shares one lease/8 of retried reads: while no
// replica answers, the first engine's check waits it out, the others read
// once, and every claim is renewed within the pass.
func TestKeepAlivesShareOneWaitForReadsWithoutResponders(t *testing.T) {
	a, _, _ := ownerOfE1(t)
	ctx := ctxT(t)
	engines := []string{"e1", "e2", "e3", "e4"}
	revs := map[string]uint64{}
	for _, e := range engines[1:] {
		mustServe(t, a, e, Request{Register: true, Local: true})
	}
	for _, e := range engines {
		revs[e] = a.Revision(e)
	}
	real := a.kv
	kv := &noRespondersKV{KeyValue: real}
	a.kv = kv
	pass, cancel := context.WithTimeout(ctx, staleLease/4) // the node's pass: until the next tick
	defer cancel()
	lost, err := a.KeepAliveAll(pass)
	require.NoError(t, err)
	require.Empty(t, lost)
	for _, e := range engines {
		require.Greater(t, a.Revision(e), revs[e], "%s renewed", e)
	}
	require.LessOrEqual(t, kv.gets.Load(), int64(staleLease/8/(20*time.Millisecond))+2+int64(len(engines)-1), "reads")
	a.kv = real
}

// A bucket that lost writes (its servers' unsynced tail, after a power
// loss) issues revisions again: another node's claim may get the very
// revision an owner still holds. The owner's keep-alive must not overwrite
// it (a compare-and-set on that revision would succeed): it is fenced.
// The loss is simulated at its extreme, the bucket recreated empty.
func TestAKeepAliveOnARevisionIssuedAgainIsFenced(t *testing.T) {
	a, nc, revA := ownerOfE1(t)
	ctx := ctxT(t)
	b := loseTheBucket(t, nc, staleLease)
	for i := uint64(1); i < revA; i++ { // other claims take the sequence to just below a's
		_, err := b.Resolve(ctx, fmt.Sprintf("other%d", i), Request{Register: true, Local: true})
		require.NoError(t, err)
	}
	d, err := b.Resolve(ctx, "e1", Request{Register: true, Local: true})
	require.NoError(t, err)
	require.Equal(t, ownership.Serve, d.Action, "e1 is unowned after the loss: b claims it")
	require.Equal(t, revA, b.Revision("e1"), "b's claim got a's revision")

	_, err = a.KeepAlive(ctx, "e1")
	require.ErrorIs(t, err, ErrFenced)
	now := time.Now()
	require.False(t, a.Serving("e1", now), "a no longer serves")
	require.True(t, b.Serving("e1", now), "b does")
	cur, err := b.Get(ctx, "e1")
	require.NoError(t, err)
	require.Equal(t, "gpu-b", cur.Node, "b's record stands")
}
