package engine_test

import (
	"context"
	"io"
	"log/slog"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/sched"
)

// A batch's event slice goes back for reuse (Batch.Recycle) exactly once,
// and only after every request actor applied its part: the recycler here
// poisons what it gets back, and the requests' state shows none of it. Both
// layouts are covered: events already in runs per request (grouped in
// place, handed to the request actors) and interleaved (copied first).
func TestBatchEventsRecycledOnceAfterTheRequestsApplied(t *testing.T) {
	_, nc := testkit.NATS(t)
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	lay, err := sched.NewLayout(&messages.EngineSpec{TokensPerHash: 4, BlocksPerChunk: 1, NumGPUBlocks: 64,
		Segments: []messages.Segment{{Shm: "x"}},
		Groups: []messages.GroupSpec{{Kind: "full", TokensPerBlock: 4,
			Regions: []messages.Region{{BlockStride: 8, BlockBytes: 8}}}}})
	require.NoError(t, err)
	m := metrics.Discard()
	outbox := actors.NewOutbox(nc, "kvactors", log)
	system := actor.NewActorSystem()
	t.Cleanup(system.Shutdown)
	pid := system.Root.Spawn(engine.Props(engine.Deps{Engine: "e1", Outbox: outbox,
		Metrics: engine.NewMetrics(m.Engines, m.Events, m.Store, m.Actors), Log: log,
		Releases: actors.NewReleases(outbox, "e1"), Lease: time.Minute, Closed: make(chan struct{}),
		Request: request.Deps{Engine: "e1", Layout: lay, Outbox: outbox,
			Metrics: request.NewMetrics(m.Events, m.Store, m.Actors),
			Tracer:  noop.NewTracerProvider().Tracer(""), Log: log}}))

	var mu sync.Mutex
	recycled := 0
	recycle := func(evs []messages.Event) {
		mu.Lock()
		defer mu.Unlock()
		recycled++
		require.Empty(t, evs)
		for i, ev := range evs[:cap(evs)] {
			require.Zero(t, ev, "event %d not cleared", i) // nothing kept alive
		}
		full := evs[:cap(evs)]
		for i := range full { // a reader after this sees it
			full[i] = messages.Event{Type: messages.EvTokens, Request: "r1", Computed: 999, Total: 999}
		}
	}
	send := func(seq uint64, evs ...messages.Event) {
		system.Root.Send(pid, &engine.Batch{Ctx: context.Background(), Recycle: recycle,
			Batch: messages.EventBatch{Epoch: "a", Seq: seq, Events: evs}})
	}
	add := func(id string) messages.Event {
		return messages.Event{Type: messages.EvAdded, Request: id, PromptTokens: 64, MaxOffloadTokens: -1}
	}
	tok := func(id string, n int) messages.Event {
		return messages.Event{Type: messages.EvTokens, Request: id, Computed: n, Total: n}
	}
	send(1, add("r1"), add("r2"))
	send(2, tok("r1", 4), tok("r1", 8), tok("r2", 4), tok("r2", 12))    // runs: grouped in place
	send(3, tok("r1", 16), tok("r2", 16), tok("r1", 20), tok("r2", 24)) // interleaved: copied

	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		mu.Lock()
		defer mu.Unlock()
		if recycled < 3 {
			return errString("batches not recycled yet")
		}
		return nil
	})
	ch := make(chan engine.Status, 1)
	system.Root.Send(pid, &engine.StatusQuery{Reply: ch})
	st := testkit.Recv(t, ch, 5*time.Second, "status")
	sort.Slice(st.Requests, func(i, j int) bool { return st.Requests[i].Request < st.Requests[j].Request })
	require.Len(t, st.Requests, 2)
	require.Equal(t, 20, st.Requests[0].Computed)
	require.Equal(t, 24, st.Requests[1].Computed)
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, 3, recycled, "each batch recycled exactly once")
}
