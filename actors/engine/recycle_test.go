package engine_test

import (
	"context"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// A batch's event slice goes back for reuse (Batch.Recycle) exactly once,
// and only after every request actor applied its part: the recycler here
// poisons what it gets back, and the requests' state shows none of it. Both
// layouts are covered: events already in runs per request (grouped in
// place, handed to the request actors) and interleaved (copied first).
func TestBatchEventsRecycledOnceAfterTheRequestsApplied(t *testing.T) {
	_, nc := testkit.NATS(t)
	system, pid, _ := startEngine(t, nc, make(chan struct{}))

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
