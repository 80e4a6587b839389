package engine_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/sched"
	"github.com/kvactors/kvactors/store"
)

// A batch the engine actor ran on its poster's goroutine, whose store job
// woke a waiting copy worker, comes back with CopyWoken set (the poster
// then yields, so the copy starts before its next message); one that
// stored nothing does not.
func TestABatchThatWokeACopyWorkerSaysSo(t *testing.T) {
	_, nc := testkit.NATS(t)
	system, pid, _, _ := startEngineWith(t, nc, make(chan struct{}), func(system *actor.ActorSystem, lay *sched.Layout, d *request.Deps) {
		d.Store = store.New(testkit.HeapArena(make([]byte, 64*8)), 8, nil, metrics.NewPool(nil)).Engine("e1", lay, testkit.NopDevice{})
		cfg := transfer.Config{Workers: 1, MaxInFlightBytes: 1 << 20}
		d.Queue = transfer.NewQueue(cfg, nil)
		d.Transfer = system.Root.Spawn(transfer.Props(transfer.Deps{Config: cfg, Metrics: metrics.NewTransfer(nil),
			Tracer: noop.NewTracerProvider().Tracer(""), Log: slog.New(slog.NewTextHandler(io.Discard, nil)), Queue: d.Queue}))
	})
	post := func(seq uint64, evs ...messages.Event) *engine.Batch {
		b := &engine.Batch{Ctx: context.Background(), Batch: messages.EventBatch{Epoch: "a", Seq: seq, Events: evs}}
		system.Root.Send(pid, b)
		return b
	}
	seq := uint64(0)
	seq++
	if b := post(seq, added("quiet"), tokens("quiet", 4)); b.CopyWoken.Load() {
		t.Fatal("a batch that stored nothing says it woke a copy worker")
	}
	// The copy worker waits once the transfer actor has started, and the
	// engine actor runs a batch inline when it is idle: should either not
	// hold yet, the next request's batch finds it so.
	n := 0
	testkit.Eventually(t, 10*time.Second, time.Millisecond, func() error {
		n++
		id := fmt.Sprintf("r%d", n)
		seq++
		b := post(seq, added(id), messages.Event{Type: messages.EvHashes, Request: id, Hashes: []messages.Hash{messages.Hash(id)}},
			messages.Event{Type: messages.EvBlocks, Request: id, IDs: []messages.BlockID{messages.BlockID(1 + n%60)}},
			tokens(id, 4))
		if !b.CopyWoken.Load() {
			return fmt.Errorf("%d batches with a ready chunk, none said it woke the copy worker", n)
		}
		return nil
	})
}
