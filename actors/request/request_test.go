package request_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/sched"
	"github.com/kvactors/kvactors/store"
)

// heldTransfer is a transfer actor that forwards every Submit and Cancel to
// the test, which answers JobDone when it chooses.
type heldTransfer struct{ seen chan any }

func (h *heldTransfer) Receive(c actor.Context) {
	switch m := c.Message().(type) {
	case *transfer.Submit, *transfer.Cancel:
		h.seen <- m
	}
}

// heldRig is a request actor's world with the transfer side held by the
// test: one full group of 4-token blocks of 8 bytes (one block per chunk), a
// pool of chunks chunks, and seen receiving every Submit and Cancel.
type heldRig struct {
	system *actor.ActorSystem
	deps   request.Deps
	seen   chan any
	store  *metrics.Store
}

func newHeldRig(t *testing.T, nc *nats.Conn, chunks int) heldRig {
	t.Helper()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	r := []messages.Region{{BlockStride: 8, BlockBytes: 8}}
	lay, err := sched.NewLayout(&messages.EngineSpec{TokensPerHash: 4, BlocksPerChunk: 1, NumGPUBlocks: 64,
		Segments: []messages.Segment{{Shm: "s"}}, Groups: []messages.GroupSpec{{Kind: "full", TokensPerBlock: 4, Regions: r}}})
	require.NoError(t, err)
	system := actor.NewActorSystem()
	t.Cleanup(system.Shutdown)
	seen := make(chan any, 16)
	xfer := system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return &heldTransfer{seen: seen} }))
	st := store.New(testkit.HeapArena(make([]byte, chunks*8)), 8, nil, metrics.NewPool(nil)).Engine("e", lay, testkit.NopDevice{})
	outbox := actors.NewOutbox(nc, "kvactors", log)
	sm := metrics.NewStore(nil)
	deps := request.Deps{Engine: "e", Epoch: "a", Releases: actors.NewReleases(outbox, "e"), Layout: lay, Store: st,
		Transfer: xfer, Outbox: outbox, Metrics: request.NewMetrics(metrics.NewEvents(nil), sm, metrics.NewActors(nil)),
		Tracer: noop.NewTracerProvider().Tracer(""), Log: log, Timers: actors.NewTimers(system.Root, sm.RetriesPending)}
	t.Cleanup(deps.Timers.Stop)
	return heldRig{system: system, deps: deps, seen: seen, store: sm}
}

// Regression: a store job still queued when the request is preempted,
// resumed and finished is cancelled late; its chunks must be stored again
// from the fresh blocks and the request released (it used to stall for ever,
// holding the engine's blocks).
func TestLateCancelAfterResumeAndFinishStillReleases(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e.released")
	rig := newHeldRig(t, nc, 16)
	system, deps, seen := rig.system, rig.deps, rig.seen
	pid := request.NewSpawner().Spawn(system.Root, &deps, &messages.Event{Type: messages.EvAdded, Request: "r",
		PromptTokens: 8, MaxOffloadTokens: -1}, context.Background())
	send := func(evs ...messages.Event) {
		for i := range evs {
			evs[i].Request = "r"
		}
		system.Root.Send(pid, &request.Events{Events: evs})
	}
	send(messages.Event{Type: messages.EvHashes, Hashes: []messages.Hash{"h0", "h1"}},
		messages.Event{Type: messages.EvBlocks, IDs: []messages.BlockID{1, 2}},
		messages.Event{Type: messages.EvTokens, Computed: 8, Total: 8})
	first := testkit.Recv(t, seen, 5*time.Second, "first store job").(*transfer.Submit)
	require.Len(t, first.Chunks, 2)

	// Preempted while the job is queued: the actor asks to cancel it; the
	// transfer actor answers only after resumed and finished.
	send(messages.Event{Type: messages.EvPreempted})
	cancel := testkit.Recv(t, seen, 5*time.Second, "cancel").(*transfer.Cancel)
	require.Equal(t, []sched.JobID{first.ID}, cancel.IDs)
	send(messages.Event{Type: messages.EvResumed},
		messages.Event{Type: messages.EvBlocks, IDs: []messages.BlockID{5, 6}},
		messages.Event{Type: messages.EvTokens, Computed: 8, Total: 8},
		messages.Event{Type: messages.EvFinished, Computed: 8, Total: 8})
	first.Store.Abort(first.Dir, first.Chunks) // what the transfer actor does for a cancelled job
	system.Root.RequestWithCustomSender(pid, &transfer.JobDone{ID: first.ID, Cancelled: true}, deps.Transfer)

	second := testkit.Recv(t, seen, 5*time.Second, "the chunks stored again").(*transfer.Submit)
	require.Equal(t, []messages.BlockID{5}, second.Chunks[0].Blocks, "from the fresh blocks")
	require.Equal(t, []messages.BlockID{6}, second.Chunks[1].Blocks)
	require.NoError(t, second.Store.Copy(second.Dir, second.Chunks, nil))
	system.Root.Send(pid, &transfer.JobDone{ID: second.ID})

	var reasons []string
	for len(reasons) < 2 {
		var rel messages.Released
		require.NoError(t, json.Unmarshal(testkit.Recv(t, released, 5*time.Second, "released").Data, &rel))
		reasons = append(reasons, rel.Reason)
	}
	require.Equal(t, []string{"preempted", "finished"}, reasons)
}

// A request actor restarted by a supervisor that restarts (protoactor's
// default; the engine's stops instead) does not run on: the replacement
// stops at once, and the failed instance's accounts are settled: the live
// gauge and the owed count go back to zero. The failure is injected as a
// nil store, which the first store decision dereferences.
func TestRestartedRequestActorStopsWithItsAccountsSettled(t *testing.T) {
	_, nc := testkit.NATS(t)
	rig := newHeldRig(t, nc, 16)
	deps := rig.deps
	deps.Store = nil
	var owed atomic.Int64
	deps.Owed = &owed
	owed.Add(1) // as the engine's spawn does
	pid := request.NewSpawner().Spawn(rig.system.Root, &deps, &messages.Event{Type: messages.EvAdded, Request: "r",
		PromptTokens: 8, MaxOffloadTokens: -1}, context.Background())
	rig.system.Root.Send(pid, &request.Events{Events: []messages.Event{
		{Type: messages.EvHashes, Request: "r", Hashes: []messages.Hash{"h0", "h1"}},
		{Type: messages.EvBlocks, Request: "r", IDs: []messages.BlockID{1, 2}},
		{Type: messages.EvTokens, Request: "r", Computed: 8, Total: 8}}})
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if live := testutil.ToFloat64(deps.Metrics.RequestsLive); live != 0 || owed.Load() != 0 {
			return fmt.Errorf("live %v, owed %d", live, owed.Load())
		}
		if _, alive := rig.system.ProcessRegistry.Get(pid); alive {
			return fmt.Errorf("the restarted actor still runs")
		}
		return nil
	})
}

// A watched request actor (its engine actor's) that stops unreleased
// leaves its owed count up: its engine actor releases it once its copies
// end and settles the count then. Lowered at the stop, a shutdown count
// taken before the engine handles the stop would miss a release still owed.
func TestAWatchedRequestActorStoppedUnreleasedStaysOwed(t *testing.T) {
	_, nc := testkit.NATS(t)
	rig := newHeldRig(t, nc, 16)
	deps := rig.deps
	var owed atomic.Int64
	deps.Owed = &owed
	owed.Add(1) // as the engine's spawn does
	var releasing request.Releasing
	pid := request.NewSpawner().SpawnWatched(rig.system.Root, &deps, &messages.Event{Type: messages.EvAdded,
		Request: "r", PromptTokens: 8, MaxOffloadTokens: -1}, context.Background(), &releasing)
	require.NoError(t, rig.system.Root.StopFuture(pid).Wait())
	require.Zero(t, testutil.ToFloat64(deps.Metrics.RequestsLive))
	require.Equal(t, int64(1), owed.Load(), "the engine settles it with the release")
	require.False(t, releasing.Load())
}

// A request's jobs in flight end in whatever order the transfer side
// finishes them: each JobDone finds its own job (the newest is not always
// the one that ends), its chunks are stored, and the finished request is
// released once the last ends.
func TestJobsInFlightEndInAnyOrder(t *testing.T) {
	for _, order := range []string{"oldest first", "newest first"} {
		t.Run(order, func(t *testing.T) {
			_, nc := testkit.NATS(t)
			released := testkit.Subscribe(t, nc, "kvactors.e.released")
			rig := newHeldRig(t, nc, 16)
			system, deps, seen := rig.system, rig.deps, rig.seen
			pid := request.NewSpawner().Spawn(system.Root, &deps, &messages.Event{Type: messages.EvAdded,
				Request: "r", PromptTokens: 12, MaxOffloadTokens: -1}, context.Background())
			send := func(evs ...messages.Event) {
				for i := range evs {
					evs[i].Request = "r"
				}
				system.Root.Send(pid, &request.Events{Events: evs, Arrived: time.Now()})
			}
			var jobs []*transfer.Submit
			for i, h := range []messages.Hash{"h0", "h1", "h2"} {
				send(messages.Event{Type: messages.EvHashes, Start: i, Hashes: []messages.Hash{h}},
					messages.Event{Type: messages.EvBlocks, Start: i, IDs: []messages.BlockID{messages.BlockID(i + 1)}},
					messages.Event{Type: messages.EvTokens, Computed: 4 * (i + 1), Total: 4 * (i + 1)})
				jobs = append(jobs, testkit.Recv(t, seen, 5*time.Second, "store job").(*transfer.Submit))
			}
			send(messages.Event{Type: messages.EvFinished, Computed: 12, Total: 12})
			if order == "newest first" {
				slices.Reverse(jobs)
			}
			for _, j := range jobs {
				require.Len(t, j.Chunks, 1)
				require.NoError(t, j.Store.Copy(j.Dir, j.Chunks, nil))
				system.Root.RequestWithCustomSender(pid, &transfer.JobDone{ID: j.ID}, deps.Transfer)
			}
			var rel messages.Released
			require.NoError(t, json.Unmarshal(testkit.Recv(t, released, 5*time.Second, "released").Data, &rel))
			require.Equal(t, "finished", rel.Reason)
			require.Zero(t, testutil.ToFloat64(deps.Metrics.Unexpected), "a JobDone found no job")
			require.Equal(t, 3.0, testutil.ToFloat64(rig.store.ChunksStored), "every chunk stored")
			var h dto.Metric
			require.NoError(t, rig.store.StoredTime.Write(&h))
			require.Equal(t, uint64(3), h.GetHistogram().GetSampleCount(), "kvactors_store_stored_seconds: one per stored message")
			require.Positive(t, h.GetHistogram().GetSampleSum())
		})
	}
}

// A released request's actor (it may wait idle for the engine's next
// request, its state dropped: TestIdleActorsHoldNoRequestState) answers a
// late status query with the released id and phase, a late reset changes
// nothing, and the live gauge went back to zero with the release, not with
// a stop.
func TestReleasedActorAnswersLateMessages(t *testing.T) {
	nc, rig, deps, pid, released := releasedRequest(t)
	rig.system.Root.Send(pid, &request.Reset{Reason: messages.ReasonEngineGone})
	rig.system.Root.Send(pid, request.RetryDueFor(1, 1)) // a retry armed before the release, due after it
	reply := make(chan *request.Status, 1)
	asker := rig.system.Root.Spawn(actor.PropsFromFunc(func(c actor.Context) {
		if st, ok := c.Message().(*request.Status); ok {
			reply <- st
		}
	}))
	rig.system.Root.Send(pid, &request.StatusQuery{ReplyTo: asker})
	st := testkit.Recv(t, reply, 5*time.Second, "status")
	require.Equal(t, sched.RequestSnapshot{Request: "r", Phase: sched.Done}, st.Snapshot)
	require.Zero(t, testutil.ToFloat64(deps.Metrics.RequestsLive))
	require.NoError(t, nc.Flush()) // a release published by the reset is in released now
	select {
	case m := <-released:
		t.Fatalf("a second release after a late reset: %s", m.Data)
	default:
	}
}

// A request raises its releasing flag before its final release goes out:
// an engine that reads the release may reuse the request id at once, and
// its engine actor must by then route the id's events to a new request, not
// to this finished one (whose Done may reach the engine actor later). The
// flag is read when the release arrives over NATS, as the engine reads it;
// a release that is not final (preempted) leaves it down.
func TestTheReleasingFlagIsUpBeforeTheFinalRelease(t *testing.T) {
	_, nc := testkit.NATS(t)
	rig := newHeldRig(t, nc, 16)
	var releasing request.Releasing
	seenAt := make(chan bool, 2)
	_, err := nc.Subscribe("kvactors.e.released", func(*nats.Msg) { seenAt <- releasing.Load() })
	require.NoError(t, err)
	require.NoError(t, nc.Flush())
	pid := request.NewSpawner().SpawnWatched(rig.system.Root, &rig.deps, &messages.Event{Type: messages.EvAdded,
		Request: "r", PromptTokens: 8, MaxOffloadTokens: -1}, context.Background(), &releasing)
	send := func(ev messages.Event) {
		ev.Request = "r"
		rig.system.Root.Send(pid, &request.Events{Events: []messages.Event{ev}})
	}
	send(messages.Event{Type: messages.EvPreempted}) // no blocks: released at once, not for good
	require.False(t, testkit.Recv(t, seenAt, 5*time.Second, "the preemption's release"), "a preemption is not the end")
	send(messages.Event{Type: messages.EvResumed})
	send(messages.Event{Type: messages.EvFinished, Computed: 0, Total: 8})
	require.True(t, testkit.Recv(t, seenAt, 5*time.Second, "the final release"), "raised before the release went out")
}

// An event that reaches a request's actor after its final release (its
// engine actor routed it before the release raised releasing: a JobDone
// run inline released the request first) is rejected `released`, once per
// event, as one that the request itself rejects (PROTOCOL.md, rejections).
func TestEventsAfterTheReleaseAreRejectedReleased(t *testing.T) {
	_, rig, deps, pid, released := releasedRequest(t)
	appliedBefore := testutil.ToFloat64(deps.Metrics.EventsApplied) // the finished event
	applied := make(chan struct{}, 1)
	rig.system.Root.Send(pid, &request.Events{Events: []messages.Event{
		{Type: messages.EvTokens, Request: "r", Computed: 8, Total: 8},
		{Type: messages.EvHashes, Request: "r", Hashes: []messages.Hash{"h0"}}},
		Applied: actors.SignalFunc(func() { applied <- struct{}{} })})
	testkit.Recv(t, applied, 5*time.Second, "the late events handled")
	rejected := deps.Metrics.Rejected.WithLabelValues(messages.RejectReleased)
	require.Equal(t, 2.0, testutil.ToFloat64(rejected), "kvactors_events_rejected_total{reason=released}")
	require.Equal(t, appliedBefore, testutil.ToFloat64(deps.Metrics.EventsApplied), "nothing applied")
	testkit.NoRecv(t, released, 100*time.Millisecond, "a second release for the late events")
}

// releasedRequest spawns request r (deps: rig.deps) on a NATS of its own
// (nc), finishes it with nothing to store and waits for its release;
// released subscribes to the engine's later releases.
func releasedRequest(t *testing.T) (*nats.Conn, heldRig, request.Deps, *actor.PID, <-chan *nats.Msg) {
	t.Helper()
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e.released")
	rig := newHeldRig(t, nc, 16)
	deps := rig.deps
	pid := request.NewSpawner().Spawn(rig.system.Root, &deps, &messages.Event{Type: messages.EvAdded, Request: "r",
		PromptTokens: 8, MaxOffloadTokens: -1}, context.Background())
	rig.system.Root.Send(pid, &request.Events{Events: []messages.Event{
		{Type: messages.EvFinished, Request: "r", Computed: 8, Total: 8}}})
	testkit.Recv(t, released, 5*time.Second, "released")
	return nc, rig, deps, pid, released
}
