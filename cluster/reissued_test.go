package cluster

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
)

// laggingDeposedKV is a deposed stream leader's stale refusal (its next
// stale Updates) seen beside a replica that lags a loss of the bucket's
// writes: its Gets of the key show old, this node's record from before the
// loss, at the revision the bucket has since issued again to another node.
type laggingDeposedKV struct {
	jetstream.KeyValue
	old   jetstream.KeyValueEntry
	stale atomic.Int64
}

func (k *laggingDeposedKV) Get(ctx context.Context, key string) (jetstream.KeyValueEntry, error) {
	if key == k.old.Key() {
		return k.old, nil
	}
	return k.KeyValue.Get(ctx, key)
}

func (k *laggingDeposedKV) Update(ctx context.Context, key string, value []byte, rev uint64) (uint64, error) {
	if k.stale.Add(-1) >= 0 {
		return 0, refusal(jetstream.JSErrCodeStreamWrongLastSequence, fmt.Sprintf("wrong last sequence: %d", rev-1))
	}
	return k.KeyValue.Update(ctx, key, value, rev)
}

// A refusal below the claim's revision is refuted only by the stream
// leader's record at that revision, not by a replica's: one that lags a
// loss of the bucket's writes still shows this node's record at a revision
// the bucket issued again to another node, and a keep-alive retried on it
// overwrote that node's claim (two owners until its next keep-alive).
func TestAStaleRefusalIsRefutedOnlyByTheLeadersRecord(t *testing.T) {
	a, nc, rev := ownerOfE1(t)
	ctx := ctxT(t)
	old, err := a.kv.Get(ctx, "e1") // a's record at rev, as a lagging replica keeps it
	require.NoError(t, err)
	b := loseTheBucket(t, nc, staleLease)
	mustServe(t, b, "e1", Request{Register: true, Local: true})
	require.Equal(t, rev, b.Revision("e1"), "the loss issues a's revision again, to b")

	real := a.kv
	kv := &laggingDeposedKV{KeyValue: real, old: old}
	kv.stale.Store(1)
	a.kv = kv
	_, err = a.KeepAlive(ctx, "e1")
	a.kv = real
	require.ErrorIs(t, err, ErrFenced)
	e, err := b.Get(ctx, "e1")
	require.NoError(t, err)
	require.Equal(t, b.me, e.Identity, "b's claim overwritten by a's keep-alive")
}
