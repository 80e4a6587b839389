package request_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// gatedRoom has no room while full is up, else the store's own; it keeps
// the room waits it is given.
type gatedRoom struct {
	request.Store
	full atomic.Bool
	mu   sync.Mutex
	room []hostpool.StaleWaker
}

func (s *gatedRoom) PrepareStoreInto(out *hostpool.Prepared, keys []messages.Key, sizes []int64) error {
	if s.full.Load() {
		out.Reset()
		return hostpool.ErrNoRoom
	}
	return s.Store.PrepareStoreInto(out, keys, sizes)
}
func (s *gatedRoom) WaitPending([]messages.Key, hostpool.Waker) {}
func (s *gatedRoom) WaitRoom(w hostpool.Waker, _ uint64) {
	s.mu.Lock()
	s.room = append(s.room, w.(hostpool.StaleWaker))
	s.mu.Unlock()
}

func (s *gatedRoom) waits() []hostpool.StaleWaker {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]hostpool.StaleWaker(nil), s.room...)
}

// spawnReady spawns r1 with one chunk ready on rig's store.
func spawnReady(rig *heldRig) *actor.PID {
	pid := request.NewSpawner().Spawn(rig.system.Root, &rig.deps, &messages.Event{Type: messages.EvAdded, Request: "r1",
		PromptTokens: 4, MaxOffloadTokens: -1}, context.Background())
	rig.system.Root.Send(pid, &request.Events{Events: []messages.Event{
		{Type: messages.EvHashes, Request: "r1", Hashes: []messages.Hash{"h"}},
		{Type: messages.EvBlocks, Request: "r1", IDs: []messages.BlockID{1}},
		{Type: messages.EvTokens, Request: "r1", Computed: 4, Total: 4}}})
	return pid
}

// A retry its timer takes (and whose decision then finds room) leaves its
// room wait stale: kept live, the room queue would wake this request, which
// wants nothing, in place of one still waiting for room (which then waits
// out its backoff).
func TestARetryTakenByItsTimerLeavesItsRoomWaitStale(t *testing.T) {
	_, nc := testkit.NATS(t)
	rig := newHeldRig(t, nc, 16)
	rs := &gatedRoom{Store: rig.deps.Store}
	rs.full.Store(true)
	rig.deps.Store = rs
	spawnReady(&rig)
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if len(rs.waits()) == 0 {
			return errors.New("r1 waits for no room")
		}
		return nil
	})
	rs.full.Store(false) // the next timer's decision finds room
	testkit.Recv(t, rig.seen, 5*time.Second, "r1's store job once its timer fell due")
	for i, w := range rs.waits() {
		require.True(t, w.Stale(), "room wait %d of a retry taken is stale", i)
	}
}

// A wake-up of an earlier retry (sent before that retry was taken, arriving
// after) decides nothing: only the retry armed now may be woken. No timer
// falls due here (stopped), so every decision is the test's.
func TestAWakeUpOfAnEarlierRetryDecidesNothing(t *testing.T) {
	_, nc := testkit.NATS(t)
	rig := newHeldRig(t, nc, 16)
	rig.deps.Timers.Stop() // the wake-ups are sent by the test
	rs := &gatedRoom{Store: rig.deps.Store}
	rs.full.Store(true)
	rig.deps.Store = rs
	pid := spawnReady(&rig)
	retries := rig.store.Retries.WithLabelValues("pool_full")
	settled := func() {
		f := actor.NewFuture(rig.system, 5*time.Second)
		rig.system.Root.Send(pid, &request.StatusQuery{ReplyTo: f.PID()})
		_, err := f.Result()
		require.NoError(t, err)
	}
	settled()
	require.Equal(t, 1.0, testutil.ToFloat64(retries), "retry 1 armed")

	rig.system.Root.Send(pid, request.WokenRetryDueFor(1, 1))
	settled()
	require.Equal(t, 2.0, testutil.ToFloat64(retries), "retry 1 woken, failed again: retry 2 armed")

	rig.system.Root.Send(pid, request.WokenRetryDueFor(1, 1)) // retry 1's, late
	settled()
	require.Equal(t, 2.0, testutil.ToFloat64(retries), "a wake-up of retry 1 decided for retry 2")

	rig.system.Root.Send(pid, request.WokenRetryDueFor(1, 2))
	settled()
	require.Equal(t, 3.0, testutil.ToFloat64(retries), "retry 2's own wake-up decides")
	select {
	case m := <-rig.seen:
		t.Fatalf("no room, yet %T", m)
	default:
	}
}

// A copy that fails in a batch of completions backs off before its chunks
// are offered again, also when a completion ahead of it in the batch owes a
// decision: that decision is taken before the failure is recorded, as if
// each completion had come alone, not after it, where it would store the
// failed chunks again at once. No timer falls due here (stopped).
func TestAFailedCopyBacksOffBehindACompletionOfItsBatch(t *testing.T) {
	_, nc := testkit.NATS(t)
	rig := newHeldRig(t, nc, 16)
	rig.deps.Timers.Stop()
	pid := request.NewSpawner().Spawn(rig.system.Root, &rig.deps, &messages.Event{Type: messages.EvAdded, Request: "r1",
		PromptTokens: 8, MaxOffloadTokens: -1}, context.Background())
	rig.system.Root.Send(pid, &request.Events{Events: []messages.Event{
		{Type: messages.EvHashes, Request: "r1", Hashes: []messages.Hash{"h0", "h1"}},
		{Type: messages.EvBlocks, Request: "r1", IDs: []messages.BlockID{1, 2}},
		{Type: messages.EvTokens, Request: "r1", Computed: 4, Total: 8}}})
	a := testkit.Recv(t, rig.seen, 5*time.Second, "the first chunk's job").(*transfer.Submit)
	rig.system.Root.Send(pid, &request.Events{Events: []messages.Event{
		{Type: messages.EvTokens, Request: "r1", Computed: 8, Total: 8}}})
	b := testkit.Recv(t, rig.seen, 5*time.Second, "the second chunk's job").(*transfer.Submit)

	// One batch of completions: a stored, then b failed (its room given
	// back, as the transfer side does).
	require.NoError(t, a.Store.Copy(a.Dir, a.Chunks, nil))
	rig.system.Root.Send(pid, &transfer.JobDone{ID: a.ID, More: true})
	b.Store.Abort(b.Dir, b.Chunks)
	rig.system.Root.Send(pid, &transfer.JobDone{ID: b.ID, Err: errors.New("copy failed"), More: false})
	f := actor.NewFuture(rig.system, 5*time.Second)
	rig.system.Root.Send(pid, &request.StatusQuery{ReplyTo: f.PID()})
	_, err := f.Result()
	require.NoError(t, err)
	require.Equal(t, 1.0, testutil.ToFloat64(rig.store.Retries.WithLabelValues("copy_failed")), "b's retry armed")
	select {
	case m := <-rig.seen:
		t.Fatalf("the failed chunk stored again before its backoff: %T", m)
	default:
	}
}
