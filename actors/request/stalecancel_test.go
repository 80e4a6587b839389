package request_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/sched"
)

// parentStub is an engine reduced to its spawner: it spawns on demand and
// takes actors back on Done.
type parentStub struct {
	sp   *request.Spawner
	deps *request.Deps
	pids chan *actor.PID
	idle chan int
}
type spawnMsg struct{ added messages.Event }
type idleQ struct{}

func (p *parentStub) Receive(c actor.Context) {
	switch m := c.Message().(type) {
	case *spawnMsg:
		p.pids <- p.sp.Spawn(c, p.deps, &m.added, context.Background())
	case *request.Done:
		p.sp.Release(c, m.PID)
	case *idleQ:
		p.idle <- p.sp.Idle()
	}
}

type blockStore struct{ entered, release chan struct{} }

func (b blockStore) Copy(backend.Direction, []sched.JobChunk, func() error) error {
	close(b.entered)
	<-b.release
	return nil
}
func (b blockStore) Abort(backend.Direction, []sched.JobChunk) {}

// A reused request actor numbers its jobs after its earlier requests': the
// transfer side matches a Cancel by owner and job id, and a Cancel sent for a
// released request (reset while its copy was running) may reach it only
// after the actor serves the next request. Found by review: with ids
// restarting at 1, that stale Cancel removed the next request's queued job.
func TestStaleCancelOfAReleasedRequestSparesTheNextOne(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e.released")
	rig := newHeldRig(t, nc, 16)
	system, deps, seen := rig.system, rig.deps, rig.seen
	par := &parentStub{sp: request.NewSpawner(), deps: &deps, pids: make(chan *actor.PID, 1), idle: make(chan int, 1)}
	parent := system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return par }))
	spawn := func(id string) *actor.PID {
		system.Root.Send(parent, &spawnMsg{added: messages.Event{Type: messages.EvAdded, Request: id, PromptTokens: 4, MaxOffloadTokens: -1}})
		return testkit.Recv(t, par.pids, 5*time.Second, "pid")
	}
	events := func(pid *actor.PID, id string, h messages.Hash, blk messages.BlockID) {
		system.Root.Send(pid, &request.Events{Events: []messages.Event{
			{Type: messages.EvHashes, Request: id, Hashes: []messages.Hash{h}},
			{Type: messages.EvBlocks, Request: id, IDs: []messages.BlockID{blk}},
			{Type: messages.EvTokens, Request: id, Computed: 4, Total: 4}}})
	}

	// r1: one job, already copying (the worker has it) when the engine resets r1.
	p1 := spawn("r1")
	events(p1, "r1", "h0", 1)
	job1 := testkit.Recv(t, seen, 5*time.Second, "r1's job").(*transfer.Submit)
	system.Root.Send(p1, &request.Reset{Reason: messages.ReasonEngineGone})
	staleCancel := testkit.Recv(t, seen, 5*time.Second, "r1's cancel").(*transfer.Cancel)
	// The copy completes before the transfer actor gets to the Cancel (it is
	// behind the completion in the transfer actor's mailbox / turn).
	require.NoError(t, job1.Store.Copy(job1.Dir, job1.Chunks, nil))
	system.Root.RequestWithCustomSender(p1, &transfer.JobDone{ID: job1.ID}, deps.Transfer)
	var rel messages.Released
	require.NoError(t, json.Unmarshal(testkit.Recv(t, released, 5*time.Second, "r1 released").Data, &rel))
	require.Equal(t, "r1", rel.Request)
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		system.Root.Send(parent, &idleQ{})
		if n := <-par.idle; n != 1 {
			return io.EOF
		}
		return nil
	})

	// r2 gets r1's actor; its job's id is not one r1's Cancel names.
	p2 := spawn("r2")
	require.True(t, p2.Equal(p1), "the released actor is reused")
	events(p2, "r2", "h9", 3)
	job2 := testkit.Recv(t, seen, 5*time.Second, "r2's job").(*transfer.Submit)
	require.True(t, job2.Owner.Equal(staleCancel.Owner))
	require.NotContains(t, staleCancel.IDs, job2.ID, "r1's stale Cancel names r2's job")
	require.Greater(t, job2.ID, job1.ID)

	// A real transfer actor: its one allowed copy is held by a blocker, so
	// r2's job waits in the queue when r1's stale Cancel arrives; then the
	// blocker ends, r2's copy runs, and r2, finished, is released. Had the
	// Cancel taken r2's job, r2 would submit its chunk again to the held
	// transfer actor, which never completes it, and never be released.
	cfg := transfer.Config{Workers: 2, MaxInFlightBytes: 1}
	q := transfer.NewQueue(cfg, nil)
	blk := blockStore{entered: make(chan struct{}), release: make(chan struct{})}
	q.Submit(&transfer.Submit{Owner: actor.NewPID("nonhost", "nobody"), ID: 99, Store: blk, Bytes: 1, Dir: backend.DeviceToHost})
	realX := system.Root.Spawn(transfer.Props(transfer.Deps{Config: cfg, Metrics: metrics.NewTransfer(nil),
		Tracer: noop.NewTracerProvider().Tracer(""), Log: slog.New(slog.NewTextHandler(io.Discard, nil)), Queue: q}))
	select {
	case <-blk.entered:
	case <-time.After(5 * time.Second):
		t.Fatal("the blocking copy did not start")
	}
	q.Submit(job2)
	system.Root.Send(realX, staleCancel)
	system.Root.Send(p2, &request.Events{Events: []messages.Event{
		{Type: messages.EvFinished, Request: "r2", Computed: 4, Total: 4}}})
	close(blk.release)
	require.NoError(t, json.Unmarshal(testkit.Recv(t, released, 5*time.Second, "r2 released").Data, &rel))
	require.Equal(t, messages.Released{Request: "r2", Epoch: "a", RSeq: rel.RSeq, Reason: "finished"}, rel)
	select {
	case m := <-seen:
		t.Fatalf("r2 submitted again (its job was cancelled): %#v", m)
	default:
	}
}

// Released actors wait idle for the next request without holding the last
// one's state: 40 requests with 1 MiB of hashes each, released together,
// leave 40 idle actors and none of those bytes on the heap.
func TestIdleActorsHoldNoRequestState(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e.released")
	rig := newHeldRig(t, nc, 16)
	system, deps := rig.system, rig.deps
	par := &parentStub{sp: request.NewSpawner(), deps: &deps, pids: make(chan *actor.PID, 1), idle: make(chan int, 1)}
	parent := system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return par }))
	const n, hashBytes = 40, 64 << 10
	heap := func() uint64 {
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return ms.HeapAlloc
	}
	before := heap()
	pids := make([]*actor.PID, n)
	for i := range pids {
		id := fmt.Sprintf("r%d", i)
		system.Root.Send(parent, &spawnMsg{added: messages.Event{Type: messages.EvAdded, Request: id, PromptTokens: 4, MaxOffloadTokens: -1}})
		pids[i] = testkit.Recv(t, par.pids, 5*time.Second, "pid")
		hs := make([]messages.Hash, 16)
		for k := range hs {
			hs[k] = messages.Hash(strings.Repeat(string(rune('a'+k)), hashBytes-1) + id) // distinct, fresh
		}
		system.Root.Send(pids[i], &request.Events{Events: []messages.Event{{Type: messages.EvHashes, Request: id, Hashes: hs}}})
	}
	require.Greater(t, heap(), before+n*16*hashBytes*9/10, "the live requests hold their hashes")
	for i, pid := range pids {
		system.Root.Send(pid, &request.Events{Events: []messages.Event{
			{Type: messages.EvFinished, Request: fmt.Sprintf("r%d", i), Computed: 4, Total: 4}}})
	}
	for range n {
		testkit.Recv(t, released, 5*time.Second, "released")
	}
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		system.Root.Send(parent, &idleQ{})
		if got := <-par.idle; got != n {
			return fmt.Errorf("%d idle, want %d", got, n)
		}
		return nil
	})
	require.Less(t, heap(), before+n*16*hashBytes/4, "idle actors still hold their requests' hashes")
}
