package engine_test

import (
	"context"
	"fmt"
	"reflect"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// A batch's event slice goes back for reuse (Batch.Recycle) exactly once,
// cleared: the recycler here poisons what it gets back, and the requests'
// state shows none of it. Both layouts are covered: events already in runs
// per request (grouped in place, handed to the request actors) and
// interleaved (copied first). The request actors here are idle, so they
// apply inline before the engine's turn ends; that the slice waits for a
// busy one is TestBatchEventsWaitForABusyRequestActor's.
func TestBatchEventsRecycledOnceAfterTheRequestsApplied(t *testing.T) {
	_, nc := testkit.NATS(t)
	system, pid, _, _ := startEngine(t, nc, make(chan struct{}), nil)

	rc := &recycler{t: t}
	send := func(seq uint64, evs ...messages.Event) { rc.send(system, pid, seq, evs...) }
	send(1, added("r1"), added("r2"))
	send(2, tokens("r1", 4), tokens("r1", 8), tokens("r2", 4), tokens("r2", 12))    // runs: grouped in place
	send(3, tokens("r1", 16), tokens("r2", 16), tokens("r1", 20), tokens("r2", 24)) // interleaved: copied

	rc.await(3)
	reqs := requestsOf(t, system, pid)
	require.Len(t, reqs, 2)
	require.Equal(t, 20, reqs[0].Computed)
	require.Equal(t, 24, reqs[1].Computed)
	require.Equal(t, 3, rc.count(), "each batch recycled exactly once")
}

// recycler is a Batch.Recycle that counts what it gets back, checks it was
// cleared, and poisons it: a request that applied its part after this would
// show Computed 999.
type recycler struct {
	t        *testing.T
	mu       sync.Mutex
	recycled int
	bad      error // recycle runs on actor goroutines: checked by count
}

func (r *recycler) recycle(evs []messages.Event) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.recycled++
	full := evs[:cap(evs)]
	for i, ev := range full {
		if (!reflect.ValueOf(ev).IsZero() || len(evs) != 0) && r.bad == nil {
			r.bad = fmt.Errorf("recycled %d events, event %d not cleared: %+v", len(evs), i, ev) // nothing kept alive
		}
	}
	for i := range full {
		full[i] = messages.Event{Type: messages.EvTokens, Request: "r1", Computed: 999, Total: 999}
	}
}

func (r *recycler) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	require.NoError(r.t, r.bad)
	return r.recycled
}

func (r *recycler) await(n int) {
	r.t.Helper()
	testkit.Eventually(r.t, 5*time.Second, time.Millisecond, func() error {
		if got := r.count(); got < n {
			return fmt.Errorf("%d batches recycled, want %d", got, n)
		}
		return nil
	})
}

// send posts a batch and returns a channel closed once the engine actor has
// handled it (Batch.Done).
func (r *recycler) send(system *actor.ActorSystem, pid *actor.PID, seq uint64, evs ...messages.Event) <-chan struct{} {
	handled := make(chan struct{})
	system.Root.Send(pid, &engine.Batch{Ctx: context.Background(), Recycle: r.recycle, Done: actors.SignalFunc(func() { close(handled) }),
		Batch: messages.EventBatch{Epoch: "a", Seq: seq, Events: evs}})
	return handled
}

// gatedStore has no room, ever; its second decision blocks until gate
// closes (announcing it on blocked): the request actor making it is busy
// on the retry timer's goroutine.
type gatedStore struct {
	calls   atomic.Int32
	blocked chan struct{}
	gate    chan struct{}
}

func (g *gatedStore) PrepareStoreInto(*hostpool.Prepared, []messages.Key, []int64) error {
	if g.calls.Add(1) == 2 {
		close(g.blocked)
		<-g.gate
	}
	return fmt.Errorf("%w: gated test store", hostpool.ErrNoRoom)
}

func (g *gatedStore) Copy(backend.Direction, []sched.JobChunk, func() error) error { return nil }
func (g *gatedStore) Abort(backend.Direction, []sched.JobChunk)                    {}

// A request actor busy on another goroutine (its retry, blocked in the
// store) when the engine forwards it its part of a batch keeps the batch's
// slice from being recycled until it has applied that part; the other
// request's part is applied at once.
func TestBatchEventsWaitForABusyRequestActor(t *testing.T) {
	_, nc := testkit.NATS(t)
	store := &gatedStore{blocked: make(chan struct{}), gate: make(chan struct{})}
	system, pid, _, _ := startEngine(t, nc, make(chan struct{}), store)
	rc := &recycler{t: t}
	rc.send(system, pid, 1, added("r1"), added("r2"))
	// r1 has a ready chunk and no room: its decision fails (first call) and
	// its retry blocks (second call), on the timer's goroutine.
	rc.send(system, pid, 2, messages.Event{Type: messages.EvHashes, Request: "r1", Hashes: []messages.Hash{"h0"}},
		messages.Event{Type: messages.EvBlocks, Request: "r1", IDs: []messages.BlockID{1}},
		tokens("r1", 4))
	select {
	case <-store.blocked:
	case <-time.After(5 * time.Second):
		t.Fatal("r1's retry never reached the store")
	}
	require.Equal(t, 2, rc.count())

	select { // the engine handled batch 3: r2 applied its part, r1 holds its own
	case <-rc.send(system, pid, 3, tokens("r1", 8), tokens("r2", 12)):
	case <-time.After(5 * time.Second):
		t.Fatal("the engine never handled batch 3")
	}
	require.Equal(t, 2, rc.count(), "recycled while r1 still held its part")
	close(store.gate)
	rc.await(3)

	reqs := requestsOf(t, system, pid)
	require.Len(t, reqs, 2)
	require.Equal(t, 8, reqs[0].Computed, "r1 applied its part before the slice was reused")
	require.Equal(t, 12, reqs[1].Computed)
	require.Equal(t, 3, rc.count())
}

func added(id string) messages.Event {
	return messages.Event{Type: messages.EvAdded, Request: id, PromptTokens: 64, MaxOffloadTokens: -1}
}

func finished(id string) messages.Event {
	return messages.Event{Type: messages.EvFinished, Request: id, Computed: 4, Total: 4}
}

// sendBatch posts batch seq of epoch "a".
func sendBatch(system *actor.ActorSystem, pid *actor.PID, seq uint64, evs ...messages.Event) {
	system.Root.Send(pid, &engine.Batch{Ctx: context.Background(), Batch: messages.EventBatch{Epoch: "a", Seq: seq, Events: evs}})
}

func tokens(id string, n int) messages.Event {
	return messages.Event{Type: messages.EvTokens, Request: id, Computed: n, Total: n}
}

// statusOf is the engine's part of P.E.status.
func statusOf(t *testing.T, system *actor.ActorSystem, pid *actor.PID) engine.Status {
	t.Helper()
	ch := make(chan engine.Status, 1)
	system.Root.Send(pid, &engine.StatusQuery{Reply: ch})
	return testkit.Recv(t, ch, 5*time.Second, "status")
}

// requestsOf is the engine's live requests (P.E.status), by id.
func requestsOf(t *testing.T, system *actor.ActorSystem, pid *actor.PID) []sched.RequestSnapshot {
	t.Helper()
	st := statusOf(t, system, pid)
	sort.Slice(st.Requests, func(i, j int) bool { return st.Requests[i].Request < st.Requests[j].Request })
	return st.Requests
}
