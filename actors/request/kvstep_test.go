package request_test

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// A completion batch is one step: the BlockStored of every completed job and
// the BlockRemoved of the decisions that follow go out as one kv_events
// message for the engine, each key once, in the order it happened (stored
// before its eviction). Each job still gets its own stored message.
func TestCompletionBatchPublishesOneKVEventsMessage(t *testing.T) {
	_, nc := testkit.NATS(t)
	kvEvents := testkit.Subscribe(t, nc, "kvactors.e.kv_events")
	storedMsgs := testkit.Subscribe(t, nc, "kvactors.e.stored")
	// Room for 4 chunks of 8 bytes.
	rig := newHeldRig(t, nc, 4)
	system, deps, seen := rig.system, rig.deps, rig.seen
	spawn := func(id string) *actor.PID {
		return request.NewSpawner().Spawn(system.Root, &deps, &messages.Event{Type: messages.EvAdded, Request: id,
			PromptTokens: 8, MaxOffloadTokens: -1}, context.Background())
	}
	send := func(pid *actor.PID, id string, evs ...messages.Event) {
		for i := range evs {
			evs[i].Request = id
		}
		system.Root.Send(pid, &request.Events{Events: evs})
	}
	ready := func(pid *actor.PID, id string, h0, h1 messages.Hash, b0, b1 messages.BlockID) {
		send(pid, id, messages.Event{Type: messages.EvHashes, Hashes: []messages.Hash{h0, h1}},
			messages.Event{Type: messages.EvBlocks, IDs: []messages.BlockID{b0, b1}},
			messages.Event{Type: messages.EvTokens, Computed: 8, Total: 8})
	}
	submit := func(what string) *transfer.Submit {
		return testkit.Recv(t, seen, 5*time.Second, what).(*transfer.Submit)
	}

	// a's job copied; c's job queued, then cancelled by a preemption (its
	// room freed, its chunks offered again once the cancel is reported);
	// b's job copied into that room. The pool is full of a's and b's ready
	// chunks, a's the least recently used.
	a, b, c := spawn("a"), spawn("b"), spawn("c")
	ready(a, "a", "a0", "a1", 1, 2)
	ja := submit("a's job")
	require.NoError(t, ja.Store.Copy(ja.Dir, ja.Chunks))
	ready(c, "c", "c0", "c1", 3, 4)
	jc := submit("c's job")
	send(c, "c", messages.Event{Type: messages.EvPreempted})
	testkit.Recv(t, seen, 5*time.Second, "c's cancel")
	jc.Store.Abort(jc.Dir, jc.Chunks)
	send(c, "c", messages.Event{Type: messages.EvResumed},
		messages.Event{Type: messages.EvBlocks, IDs: []messages.BlockID{5, 6}},
		messages.Event{Type: messages.EvTokens, Computed: 8, Total: 8})
	ready(b, "b", "b0", "b1", 7, 8)
	jb := submit("b's job")
	require.NoError(t, jb.Store.Copy(jb.Dir, jb.Chunks))

	// One step: a's and b's completions, c's cancel. c's decision after it
	// evicts a's chunks to store its own again.
	step := deps.Outbox.NewKVStep()
	system.Root.Send(a, &transfer.JobDone{ID: ja.ID, KV: step})
	system.Root.Send(b, &transfer.JobDone{ID: jb.ID, KV: step})
	system.Root.Send(c, &transfer.JobDone{ID: jc.ID, Cancelled: true, KV: step})
	again := submit("c's chunks stored again")
	require.Len(t, again.Chunks, 2)
	for range 2 {
		testkit.Recv(t, storedMsgs, 5*time.Second, "one stored per job")
	}
	step.Publish()

	var batch messages.KVEventBatch
	require.NoError(t, json.Unmarshal(testkit.Recv(t, kvEvents, 5*time.Second, "kv_events").Data, &batch))
	type announced struct{ typ, hash string }
	var got []announced
	for _, ev := range batch.Events {
		for _, h := range ev.BlockHashes {
			got = append(got, announced{ev.Type, h})
		}
	}
	hx := func(s string) string { return hex.EncodeToString([]byte(s)) }
	require.Equal(t, []announced{
		{messages.KVBlockStored, hx("a0")}, {messages.KVBlockStored, hx("a1")},
		{messages.KVBlockStored, hx("b0")}, {messages.KVBlockStored, hx("b1")},
		{messages.KVBlockRemoved, hx("a0")}, {messages.KVBlockRemoved, hx("a1")},
	}, got, "every key once per event, in the order it happened, in one message")
	require.NoError(t, nc.Flush()) // anything else published is delivered by now
	select {
	case m := <-kvEvents:
		t.Fatalf("a second kv_events message for the step: %s", m.Data)
	default:
	}
}

// An Add after the step was published is refused (the caller publishes it
// itself, after the step's messages); engines are published in the order of
// their first event.
func TestKVStepOrderAndLateAdd(t *testing.T) {
	_, nc := testkit.NATS(t)
	all := testkit.Subscribe(t, nc, "kvactors.*.kv_events")
	outbox := actors.NewOutbox(nc, "kvactors", slog.New(slog.NewTextHandler(io.Discard, nil)))
	ev := func(typ, h string) []messages.KVEvent {
		return []messages.KVEvent{{Type: typ, BlockHashes: []string{h}, Medium: messages.MediumCPU}}
	}
	step := outbox.NewKVStep()
	ctx := context.Background()
	require.True(t, step.Add(ctx, "e2", ev(messages.KVBlockStored, "01")))
	require.True(t, step.Add(ctx, "e1", ev(messages.KVBlockRemoved, "01")))
	require.True(t, step.Add(ctx, "e2", ev(messages.KVBlockStored, "02")))
	require.True(t, step.Add(ctx, "e1", nil), "nothing to add is taken")
	step.Publish()
	require.False(t, step.Add(ctx, "e1", ev(messages.KVBlockStored, "03")), "published: the caller publishes")
	var nilStep *actors.KVStep
	require.False(t, nilStep.Add(ctx, "e1", ev(messages.KVBlockStored, "03")))

	want := []struct {
		subject string
		hashes  []string
	}{{"kvactors.e2.kv_events", []string{"01", "02"}}, {"kvactors.e1.kv_events", []string{"01"}}}
	for _, w := range want {
		m := testkit.Recv(t, all, 5*time.Second, w.subject)
		require.Equal(t, w.subject, m.Subject)
		var batch messages.KVEventBatch
		require.NoError(t, json.Unmarshal(m.Data, &batch))
		var hashes []string
		for _, e := range batch.Events {
			hashes = append(hashes, e.BlockHashes...)
		}
		require.Equal(t, w.hashes, hashes)
	}
	require.NoError(t, nc.Flush())
	select {
	case m := <-all:
		t.Fatalf("unexpected message on %s: %s", m.Subject, m.Data)
	default:
	}
}
