package request_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// PROTOCOL.md "Fencing, node side", lapse: a request's copies carry its
// epoch's session stamp, its retries too, so after a lapse the fence refuses
// every copy the old session's request still submits; a refusal is not
// logged as a failure (it repeats until the engine's reset ends the request).
func TestLapsedCopiesRetryWithTheOldStampQuietly(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e.released")
	rig := newHeldRig(t, nc, 16)
	system, deps, seen := rig.system, rig.deps, rig.seen
	var logs testkit.SyncBuffer
	deps.Log = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo}))
	deps.Session = 7
	pid := request.NewSpawner().Spawn(system.Root, &deps, &messages.Event{Type: messages.EvAdded, Request: "r",
		PromptTokens: 4, MaxOffloadTokens: -1}, context.Background())
	system.Root.Send(pid, &request.Events{Events: []messages.Event{
		{Type: messages.EvHashes, Request: "r", Hashes: []messages.Hash{"h0"}},
		{Type: messages.EvBlocks, Request: "r", IDs: []messages.BlockID{1}},
		{Type: messages.EvTokens, Request: "r", Computed: 4, Total: 4}}})
	for attempt := range 2 {
		sub, ok := testkit.Recv(t, seen, 5*time.Second, fmt.Sprintf("store job, attempt %d", attempt)).(*transfer.Submit)
		require.True(t, ok)
		require.Equal(t, uint64(7), sub.Session, "attempt %d not stamped with the request's session", attempt)
		deps.Store.Abort(sub.Dir, sub.Chunks) // as the transfer side does for a refused copy
		system.Root.Send(pid, &transfer.JobDone{ID: sub.ID, Err: fmt.Errorf("copy: %w", transfer.ErrSessionLapsed)})
	}
	system.Root.Send(pid, &request.Reset{Reason: messages.ReasonEngineReset})
	var rel messages.Released
	require.NoError(t, json.Unmarshal(testkit.Recv(t, released, 5*time.Second, "the reset's release").Data, &rel))
	require.Equal(t, messages.ReasonEngineReset, rel.Reason)
	require.NotContains(t, logs.String(), "store copy failed", "a lapsed copy logged as a failure")
}
