package request_test

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
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
