package request_test

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// gatedStore refuses room while refuse is set (every decision becomes a
// retry); after that each PrepareStore waits for gate, as a decision waits
// for a pool or release lock another goroutine holds.
type gatedStore struct {
	request.Store
	refuse  atomic.Bool
	gate    chan struct{}
	entered chan struct{}
}

func (s *gatedStore) PrepareStoreInto(out *hostpool.Prepared, keys []messages.Key, sizes []int64) error {
	if s.refuse.Load() {
		return errors.New("no room")
	}
	select {
	case s.entered <- struct{}{}:
	default:
	}
	<-s.gate
	return s.Store.PrepareStoreInto(out, keys, sizes)
}

// A request actor runs its retry on whoever delivers it. Retries of many
// requests whose decisions block must wait in the engine's timers, not each
// on a goroutine of its own: a 100k-request burst once held 66,000 such
// goroutines (+550 MiB of stacks). Every retry still runs once the block
// clears, and every chunk is stored.
func TestBlockedRetriesWaitInTheTimers(t *testing.T) {
	const n = 200 // the rig's engine has 64 GPU blocks: requests share them
	_, nc := testkit.NATS(t)
	rig := newHeldRig(t, nc, n)
	system, deps := rig.system, rig.deps
	gs := &gatedStore{Store: deps.Store, gate: make(chan struct{}), entered: make(chan struct{}, 1)}
	gs.refuse.Store(true)
	deps.Store = gs

	for i := range n {
		id := fmt.Sprintf("r%d", i)
		pid := request.NewSpawner().Spawn(system.Root, &deps, &messages.Event{Type: messages.EvAdded, Request: id,
			PromptTokens: 4, MaxOffloadTokens: -1}, context.Background())
		// Inline mailbox: the first decision (no room, a retry armed) runs here.
		system.Root.Send(pid, &request.Events{Events: []messages.Event{
			{Type: messages.EvHashes, Request: id, Hashes: []messages.Hash{messages.Hash(id)}},
			{Type: messages.EvBlocks, Request: id, IDs: []messages.BlockID{messages.BlockID(1 + i%63)}},
			{Type: messages.EvTokens, Request: id, Computed: 4, Total: 4}}})
	}
	// Each request armed one retry (one may be on its way through the
	// delivering goroutine, refused and re-armed, as this reads).
	require.GreaterOrEqual(t, deps.Timers.Pending(), n-1)
	before := runtime.NumGoroutine()
	gs.refuse.Store(false)
	testkit.Recv(t, gs.entered, 10*time.Second, "a retry's decision")
	require.Equal(t, n-1, deps.Timers.Pending(), "one retry blocked, the others due and waiting their turn")
	require.Equal(t, float64(n-1), testutil.ToFloat64(rig.store.RetriesPending), "kvactors_store_retries_pending")
	require.LessOrEqual(t, runtime.NumGoroutine(), before+2, "no goroutine per blocked retry")

	close(gs.gate)
	stored := map[messages.Key]bool{}
	for len(stored) < n {
		sub := testkit.Recv(t, rig.seen, 10*time.Second, "a store job").(*transfer.Submit)
		for _, c := range sub.Chunks {
			stored[c.Key] = true
		}
	}
	require.Zero(t, deps.Timers.Pending())
	require.Zero(t, testutil.ToFloat64(rig.store.RetriesPending))
}
