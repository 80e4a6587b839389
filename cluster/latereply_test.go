package cluster

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
)

// slowReplyKV holds the goroutine of the first Update after its write has
// landed and its reply come back (descheduled there, under GC or CPU
// pressure), until release.
type slowReplyKV struct {
	jetstream.KeyValue
	held     atomic.Bool
	replied  chan struct{}
	release  chan struct{}
	releaseO sync.Once
}

func (k *slowReplyKV) Update(ctx context.Context, key string, value []byte, rev uint64) (uint64, error) {
	n, err := k.KeyValue.Update(ctx, key, value, rev)
	if k.held.CompareAndSwap(false, true) {
		close(k.replied)
		<-k.release
	}
	return n, err
}

// Two writers of one held claim in one process (the ownership loop's
// keep-alive and a register's confirmation of its claim) may record their
// replies out of order: here the keep-alive's write lands at r+1 and its
// goroutine stalls before recording it, while the register's write, refused
// at r, finds r+1 its own and renews it at r+2. The keep-alive's late
// reply must not set the held revision back to r+1: the next renewal
// would be refused at r+1, date the record at r+2 from its own send (later
// than r+2's), and a renewal then lost would leave the local lease running
// past the servers' (two owners); a release would fail on the old revision
// and leave the record claimed.
func TestAnOlderWritesLateReplyDoesNotSetTheHeldRevisionBack(t *testing.T) {
	t.Parallel()
	_, nc := testkit.NATS(t)
	a := openOwnersLease(t, nc, "gpu-a", "", 1, testLease)
	mustServe(t, a, "e1", Request{Register: true, Local: true})
	r := a.Revision("e1")
	kv := &slowReplyKV{KeyValue: a.kv, replied: make(chan struct{}), release: make(chan struct{})}
	a.kv = kv
	t.Cleanup(func() { kv.releaseO.Do(func() { close(kv.release) }) })
	ctx := ctxT(t)

	keepAlive := make(chan error, 1)
	go func() {
		_, err := a.KeepAlive(ctx, "e1")
		keepAlive <- err
	}()
	testkit.Closed(t, kv.replied, 5*time.Second, "the keep-alive's write landed, its reply not recorded")
	_, err := a.KeepAlive(ctx, "e1") // the register's: refused at r, finds its own r+1, renews at r+2
	require.NoError(t, err)
	require.Equal(t, r+2, a.Revision("e1"))
	kv.releaseO.Do(func() { close(kv.release) })
	require.NoError(t, testkit.Recv(t, keepAlive, 5*time.Second, "the keep-alive's return"))
	require.Equal(t, r+2, a.Revision("e1"), "the held revision went back to the older write's")

	_, err = a.KeepAlive(ctx, "e1")
	require.NoError(t, err)
	require.Equal(t, r+3, a.Revision("e1"), "renewed from the newest revision")
	require.NoError(t, a.Release(ctx, "e1"))
	_, err = a.kv.Get(ctx, "e1")
	require.ErrorIs(t, err, jetstream.ErrKeyNotFound, "released: the record is gone")
}
