package engine_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// A request actor that panics is stopped by its engine's supervision, its
// request released as aborted and counted; the engine and the other requests
// go on (issue 3, "A request actor's failure ... is contained").
func TestRequestActorPanicIsContained(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	resyncs := testkit.Subscribe(t, nc, "kvactors.e1.resync")
	// The pool is nil: the first store decision of a request dereferences
	// it and panics, which stands in for any bug on bad state.
	closed := make(chan struct{})
	system, pid, m, timers := startEngine(t, nc, closed, nil)

	ev := func(e messages.Event) messages.Event { return e }
	system.Root.Send(pid, &engine.Batch{Ctx: context.Background(), Batch: messages.EventBatch{Epoch: "a", Seq: 1,
		Events: []messages.Event{
			ev(messages.Event{Type: messages.EvAdded, Request: "ok", PromptTokens: 4, MaxOffloadTokens: -1}),
			ev(messages.Event{Type: messages.EvAdded, Request: "boom", PromptTokens: 4, MaxOffloadTokens: -1}),
			ev(messages.Event{Type: messages.EvHashes, Request: "boom", Hashes: []messages.Hash{"h"}}),
			ev(messages.Event{Type: messages.EvBlocks, Request: "boom", IDs: []messages.BlockID{3}}),
			ev(messages.Event{Type: messages.EvTokens, Request: "boom", Computed: 4, Total: 4}),
		}}})
	var rel messages.Released
	require.NoError(t, json.Unmarshal(testkit.Recv(t, released, 5*time.Second, "release of the failed request").Data, &rel))
	require.Equal(t, messages.Released{Request: "boom", Epoch: "a", RSeq: 1, Reason: "aborted"}, rel)
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		if v := testutilValue(m); v != 1 {
			return errString("request failures not counted yet")
		}
		return nil
	})

	// The engine and the other request still work. The failure resynced
	// epoch a (the engine may still run boom, which the node forgot), so
	// they go on in the engine's next epoch, which re-announces ok.
	ch := make(chan engine.Status, 1)
	system.Root.Send(pid, &engine.StatusQuery{Reply: ch})
	st := testkit.Recv(t, ch, 5*time.Second, "status")
	require.Len(t, st.Requests, 1)
	require.Equal(t, "ok", st.Requests[0].Request)
	var rs messages.Resync
	require.NoError(t, json.Unmarshal(testkit.Recv(t, resyncs, 5*time.Second, "the failure's resync").Data, &rs))
	require.Equal(t, "a", rs.Epoch)
	system.Root.Send(pid, &engine.Batch{Ctx: context.Background(), Batch: messages.EventBatch{Epoch: "b", Seq: 1,
		Events: []messages.Event{{Type: messages.EvAdded, Request: "ok", PromptTokens: 4, MaxOffloadTokens: -1},
			{Type: messages.EvFinished, Request: "ok", Computed: 2, Total: 4}}}})
	require.NoError(t, json.Unmarshal(testkit.Recv(t, released, 5*time.Second, "release of ok").Data, &rel))
	require.Equal(t, messages.Released{Request: "ok", Epoch: "b", RSeq: 1, Reason: "finished"}, rel)

	// Retire: the engine stops once every request is released.
	system.Root.Send(pid, &engine.Retire{})
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		t.Fatal("retired engine did not stop")
	}
	timers.Send(time.Hour, pid, &engine.Tick{})
	require.Zero(t, timers.Pending(), "the stopped engine stopped its requests' timers")
}
