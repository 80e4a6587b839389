package request_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// A request whose chunk another request's copy is still filling retries
// when that copy ends, not when its backoff does: the engine gets its
// blocks back a copy's time after the chunk is stored, not up to a second
// later. r1's copy is held until r2, finished and sharing r1's prefix, has
// backed off five times (its sixth retry is armed 320 ms out); then the
// copy completes, and r2 must be released while that timer still waits.
func TestAPendingRetryIsTakenWhenTheCopyItWaitsForEnds(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e.released")
	rig := newHeldRig(t, nc, 16)
	system, deps, seen := rig.system, rig.deps, rig.seen
	sp := request.NewSpawner()
	spawn := func(id string, blk messages.BlockID, finish bool) {
		pid := sp.Spawn(system.Root, &deps, &messages.Event{Type: messages.EvAdded, Request: id,
			PromptTokens: 4, MaxOffloadTokens: -1}, context.Background())
		evs := []messages.Event{{Type: messages.EvHashes, Request: id, Hashes: []messages.Hash{"h0"}},
			{Type: messages.EvBlocks, Request: id, IDs: []messages.BlockID{blk}},
			{Type: messages.EvTokens, Request: id, Computed: 4, Total: 4}}
		if finish {
			evs = append(evs, messages.Event{Type: messages.EvFinished, Request: id, Computed: 4, Total: 4})
		}
		system.Root.Send(pid, &request.Events{Events: evs})
	}
	spawn("r1", 1, false)
	copying := testkit.Recv(t, seen, 5*time.Second, "r1's store job").(*transfer.Submit)

	spawn("r2", 2, true)
	pending := rig.store.Retries.WithLabelValues("pending")
	testkit.Eventually(t, 10*time.Second, time.Millisecond, func() error {
		if n := testutil.ToFloat64(pending); n < 6 {
			return fmt.Errorf("r2 retried %v times for the pending chunk, want 6", n)
		}
		return nil
	})
	require.Equal(t, 1, deps.Timers.Pending(), "r2's sixth retry is armed")

	// The copy ends (what the transfer worker does); nothing else happens.
	require.NoError(t, copying.Store.Copy(copying.Dir, copying.Chunks, nil))
	var rel messages.Released
	require.NoError(t, json.Unmarshal(testkit.Recv(t, released, 5*time.Second, "r2 released").Data, &rel))
	require.Equal(t, "r2", rel.Request)
	require.Equal(t, "finished", rel.Reason)
	require.Equal(t, 1, deps.Timers.Pending(), "released by the copy's end: the backoff's timer has not fallen due")
	require.Zero(t, testutil.ToFloat64(rig.store.ChunksDropped), "the chunk was stored by r1, not given up by r2")
	select {
	case m := <-seen:
		t.Fatalf("r2 stored its chunk again: %T", m)
	default:
	}
}

// An early wake-up that fails again is no attempt towards FinishRetryLimit:
// a finished request waiting on keys spread over many copies is woken once
// per copy that ends, and sixteen such wake-ups can come milliseconds
// apart; counted, they made it give up chunks that the copies it waited for
// then stored. r1 stores 17 chunks in 17 held jobs; r2, finished with the
// same prefix, finds them all pending; the copies end one at a time, each
// after r2 has taken the previous one's wake-up. r2 is released, finished,
// having given nothing up.
func TestEarlyWakeUpsSpendNoRetryAttempts(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e.released")
	rig := newHeldRig(t, nc, 64)
	system, deps, seen := rig.system, rig.deps, rig.seen
	sp := request.NewSpawner()
	const n = sched.FinishRetryLimit + 1
	hashes := make([]messages.Hash, n)
	ids1, ids2 := make([]messages.BlockID, n), make([]messages.BlockID, n)
	for i := range hashes {
		hashes[i] = messages.Hash(fmt.Sprintf("h%d", i))
		ids1[i], ids2[i] = messages.BlockID(1+i), messages.BlockID(30+i)
	}
	p1 := sp.Spawn(system.Root, &deps, &messages.Event{Type: messages.EvAdded, Request: "r1",
		PromptTokens: 4 * n, MaxOffloadTokens: -1}, context.Background())
	system.Root.Send(p1, &request.Events{Events: []messages.Event{
		{Type: messages.EvHashes, Request: "r1", Hashes: hashes},
		{Type: messages.EvBlocks, Request: "r1", IDs: ids1}}})
	var jobs []*transfer.Submit
	for i := 1; i <= n; i++ { // one chunk a step: a job each
		system.Root.Send(p1, &request.Events{Events: []messages.Event{
			{Type: messages.EvTokens, Request: "r1", Computed: 4 * i, Total: 4 * n}}})
		jobs = append(jobs, testkit.Recv(t, seen, 5*time.Second, "r1's job").(*transfer.Submit))
	}
	p2 := sp.Spawn(system.Root, &deps, &messages.Event{Type: messages.EvAdded, Request: "r2",
		PromptTokens: 4 * n, MaxOffloadTokens: -1}, context.Background())
	system.Root.Send(p2, &request.Events{Events: []messages.Event{
		{Type: messages.EvHashes, Request: "r2", Hashes: hashes},
		{Type: messages.EvBlocks, Request: "r2", IDs: ids2},
		{Type: messages.EvTokens, Request: "r2", Computed: 4 * n, Total: 4 * n},
		{Type: messages.EvFinished, Request: "r2", Computed: 4 * n, Total: 4 * n}}})
	retries := rig.store.Retries.WithLabelValues("pending")
	waitRetries := func(atLeast float64) {
		testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
			if got := testutil.ToFloat64(retries); got < atLeast {
				return fmt.Errorf("%v pending retries, want %v", got, atLeast)
			}
			return nil
		})
	}
	waitRetries(1) // r2 found every key pending
	for i, j := range jobs {
		before := testutil.ToFloat64(retries)
		require.NoError(t, j.Store.Copy(j.Dir, j.Chunks, nil))
		if i < len(jobs)-1 {
			waitRetries(before + 1) // woken, and the next key still pending
		}
	}
	var rel messages.Released
	require.NoError(t, json.Unmarshal(testkit.Recv(t, released, 5*time.Second, "r2 released").Data, &rel))
	require.Equal(t, "r2", rel.Request)
	require.Equal(t, "finished", rel.Reason)
	require.Zero(t, testutil.ToFloat64(rig.store.ChunksDropped), "r2 gave nothing up: r1 stored every chunk")
}

// roomStore has no room, ever, and keeps the room waits it is given.
type roomStore struct {
	request.Store
	mu   sync.Mutex
	room []hostpool.Waker
}

func (s *roomStore) PrepareStoreInto(out *hostpool.Prepared, _ []messages.Key, _ []int64) error {
	out.Reset()
	return hostpool.ErrNoRoom
}
func (s *roomStore) WaitPending([]messages.Key, hostpool.Waker) {}
func (s *roomStore) WaitRoom(w hostpool.Waker, _ uint64) {
	s.mu.Lock()
	s.room = append(s.room, w)
	s.mu.Unlock()
}

// A request released while its room wait is queued leaves a wake-up that
// the room queue must see as stale, or each such one takes the turn of a
// request still waiting (which then waits out its backoff).
func TestARoomWaitOfAReleasedRequestIsStale(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e.released")
	rig := newHeldRig(t, nc, 16)
	system, deps := rig.system, rig.deps
	rs := &roomStore{Store: deps.Store}
	deps.Store = rs
	pid := request.NewSpawner().Spawn(system.Root, &deps, &messages.Event{Type: messages.EvAdded, Request: "r1",
		PromptTokens: 4, MaxOffloadTokens: -1}, context.Background())
	system.Root.Send(pid, &request.Events{Events: []messages.Event{
		{Type: messages.EvHashes, Request: "r1", Hashes: []messages.Hash{"h"}},
		{Type: messages.EvBlocks, Request: "r1", IDs: []messages.BlockID{1}},
		{Type: messages.EvTokens, Request: "r1", Computed: 4, Total: 4}}})
	var w hostpool.StaleWaker
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		rs.mu.Lock()
		defer rs.mu.Unlock()
		if len(rs.room) != 1 {
			return fmt.Errorf("%d room waits, want 1", len(rs.room))
		}
		w = rs.room[0].(hostpool.StaleWaker)
		return nil
	})
	require.False(t, w.Stale(), "r1 waits for room")
	system.Root.Send(pid, &request.Reset{Reason: "engine_reset"})
	testkit.Recv(t, released, 5*time.Second, "r1 released")
	require.True(t, w.Stale(), "the released request's room wait passes its turn on")
}

// An early wake-up that fails again takes over the timer still running
// instead of starting one of its own: woken failures spend no attempts, so
// wake-ups faster than the backoff, each restarting it, would keep every
// timer from falling due, and a finished request the pool keeps refusing
// would never give up and be released (chaos-tagged
// TestAFinishedRequestWokenForRoomStillGivesUp waits that out). r1, finished,
// finds no room 30 times over, woken each time: never more than one timer.
func TestAWokenRetryTakesOverTheRunningTimer(t *testing.T) {
	_, nc := testkit.NATS(t)
	rig, rs := finishedWithNoRoom(t, nc)
	retries := rig.store.Retries.WithLabelValues("pool_full")
	for i := 0; i < 30; i++ {
		var w hostpool.Waker
		testkit.Eventually(t, 5*time.Second, 100*time.Microsecond, func() error {
			rs.mu.Lock()
			defer rs.mu.Unlock()
			if len(rs.room) == 0 {
				return errors.New("r1 waits for no room")
			}
			w, rs.room = rs.room[len(rs.room)-1], nil
			return nil
		})
		before := testutil.ToFloat64(retries)
		w.Wake()
		testkit.Eventually(t, 5*time.Second, 100*time.Microsecond, func() error {
			if testutil.ToFloat64(retries) <= before {
				return errors.New("the woken retry has not decided")
			}
			return nil
		})
		require.LessOrEqual(t, rig.deps.Timers.Pending(), 1, "wake-up %d started a timer of its own", i)
	}
}

// finishedWithNoRoom spawns r1, finished with one chunk ready, on a store
// that never has room (roomStore, returned with the rig).
func finishedWithNoRoom(t *testing.T, nc *nats.Conn) (*heldRig, *roomStore) {
	t.Helper()
	rig := new(heldRig)
	*rig = newHeldRig(t, nc, 16)
	rs := &roomStore{Store: rig.deps.Store}
	rig.deps.Store = rs
	pid := request.NewSpawner().Spawn(rig.system.Root, &rig.deps, &messages.Event{Type: messages.EvAdded, Request: "r1",
		PromptTokens: 4, MaxOffloadTokens: -1}, context.Background())
	rig.system.Root.Send(pid, &request.Events{Events: []messages.Event{
		{Type: messages.EvHashes, Request: "r1", Hashes: []messages.Hash{"h"}},
		{Type: messages.EvBlocks, Request: "r1", IDs: []messages.BlockID{1}},
		{Type: messages.EvTokens, Request: "r1", Computed: 4, Total: 4},
		{Type: messages.EvFinished, Request: "r1", Computed: 4, Total: 4}}})
	return rig, rs
}
