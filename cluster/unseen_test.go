package cluster

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
)

// unseenKV is the bucket read through a replica that has not seen the
// key's first write (cut off when it was written, still catching up): its
// next unseen reads are not found, as such a replica answers a direct get,
// then it has caught up. Writes go to the KeyValue it wraps.
type unseenKV struct {
	jetstream.KeyValue
	unseen atomic.Int64
}

func (k *unseenKV) Get(ctx context.Context, key string) (jetstream.KeyValueEntry, error) {
	if k.unseen.Add(-1) >= 0 {
		return nil, jetstream.ErrKeyNotFound
	}
	return k.KeyValue.Get(ctx, key)
}

// A refusal below the claim's revision is explained by a read of the
// record at that revision; the first read after it comes from a replica
// that has not seen the key, and shows none. That is no deletion: the key
// was never gone. The read is confirmed at the stream leader, which shows
// the record, and the write is tried again. Before, "no record" was taken
// for the record deleted after the revision, and the claim was fenced,
// nobody else having written.
func TestANoRecordReadBelowAStaleRefusalIsNoFence(t *testing.T) {
	a, _, first := ownerOfE1(t)
	ctx := ctxT(t)
	rev, err := a.KeepAlive(ctx, "e1") // the deposed leader's store stops at first
	require.NoError(t, err)

	real := a.kv
	dep := &deposedLeaderKV{KeyValue: real, last: first}
	dep.stale.Store(1)
	kv := &unseenKV{KeyValue: dep}
	kv.unseen.Store(2) // the keep-alive's check, then the first read after the refusal
	a.kv = kv
	pass, cancel := context.WithTimeout(ctx, staleLease/4)
	defer cancel()
	nrev, err := a.KeepAlive(pass, "e1")
	require.NoError(t, err, "a replica that had not seen the key fenced the claim")
	require.Greater(t, nrev, rev)
	require.Zero(t, kv.unseen.Load(), "both not-found reads were served")
	require.True(t, a.Serving("e1", time.Now()))
	require.Zero(t, testutil.ToFloat64(a.metrics.Fenced))
	require.Equal(t, 1.0, testutil.ToFloat64(a.metrics.Unsettled.WithLabelValues("stale")))
	a.kv = real
}

// landedRefusedOnceKV commits its first Update and answers it as a deposed
// stream leader would first (another write in process, 10164); the rest
// pass through.
type landedRefusedOnceKV struct {
	jetstream.KeyValue
	done atomic.Bool
}

func (k *landedRefusedOnceKV) Update(ctx context.Context, key string, value []byte, rev uint64) (uint64, error) {
	n, err := k.KeyValue.Update(ctx, key, value, rev)
	if err != nil || k.done.Swap(true) {
		return n, err
	}
	return 0, refusal(jetstream.JSErrCodeStreamWrongLastSequenceConstant, "wrong last sequence")
}

// A keep-alive's write lands with its reply lost, and its retry is refused
// past the claim's revision; the read that looks for the write past it
// comes from a replica that has not seen the key, and shows none. That is
// not the record deleted after the revision: confirmed at the stream
// leader, the read shows the node's own landed write, and the keep-alive
// renews on it. Before, the claim was fenced on that one read. A record
// the stream leader shows deleted past the revision is still a fence,
// whatever the lagging replica answers.
func TestANoRecordReadPastARefusalIsNotADeletion(t *testing.T) {
	a, _, rev := ownerOfE1(t)
	ctx := ctxT(t)

	real := a.kv
	kv := &unseenKV{KeyValue: &landedRefusedOnceKV{KeyValue: real}}
	kv.unseen.Store(2) // the keep-alive's check, then the first read past the revision
	a.kv = kv
	pass, cancel := context.WithTimeout(ctx, staleLease/4)
	defer cancel()
	nrev, err := a.KeepAlive(pass, "e1")
	require.NoError(t, err, "a replica that had not seen the key fenced the claim")
	require.Greater(t, nrev, rev+1, "renewed past its own landed write")
	require.Zero(t, kv.unseen.Load(), "both not-found reads were served")
	require.True(t, a.Serving("e1", time.Now()))
	require.Zero(t, testutil.ToFloat64(a.metrics.Fenced))
	require.Equal(t, 1.0, testutil.ToFloat64(a.metrics.Unsettled.WithLabelValues("landed")))

	require.NoError(t, real.Delete(ctx, "e1")) // deleted past the claim's revision
	kv.unseen.Store(1 << 30)                   // every direct read still shows none
	pass, cancel = context.WithTimeout(ctx, staleLease/4)
	defer cancel()
	_, err = a.KeepAlive(pass, "e1")
	require.ErrorIs(t, err, ErrFenced, "the stream leader shows the record deleted past the revision")
	require.Empty(t, a.Mine())
	a.kv = real
}

// The confirming read is the stream leader's (the API's STREAM.MSG.GET),
// never a direct get, which the lagging replica itself may answer; it
// shows the record, a delete past it, and a key never written.
func TestALeaderReadIsNoDirectGet(t *testing.T) {
	a, nc, rev := ownerOfE1(t)
	ctx := ctxT(t)
	get, err := nc.SubscribeSync("$JS.API.STREAM.MSG.GET.KV_kvactors_owners")
	require.NoError(t, err)
	direct, err := nc.SubscribeSync("$JS.API.DIRECT.GET.>")
	require.NoError(t, err)

	e, last, err := a.leaderRead(ctx, "e1")
	require.NoError(t, err)
	require.NotNil(t, e)
	require.Equal(t, rev, e.Revision)
	require.Equal(t, rev, last)
	require.Equal(t, "gpu-a", e.Node)
	_, err = get.NextMsg(5 * time.Second)
	require.NoError(t, err, "asked the stream leader")
	require.NoError(t, nc.Flush())
	n, _, err := direct.Pending()
	require.NoError(t, err)
	require.Zero(t, n, "no direct get")

	require.NoError(t, a.kv.Delete(ctx, "e1"))
	e, last, err = a.leaderRead(ctx, "e1")
	require.NoError(t, err)
	require.Nil(t, e)
	require.Greater(t, last, rev, "the delete's marker")

	e, last, err = a.leaderRead(ctx, "e2")
	require.NoError(t, err)
	require.Nil(t, e)
	require.Zero(t, last, "never written")
}
