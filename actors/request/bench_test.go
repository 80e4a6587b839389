package request_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/sched"
)

// benchLayout: 2 groups, 16-token blocks, tph 16, bpc 1.
func benchLayout(b *testing.B) *sched.Layout {
	r := []messages.Region{{BlockStride: 64, BlockBytes: 64}}
	l, err := sched.NewLayout(&messages.EngineSpec{TokensPerHash: 16, BlocksPerChunk: 1, NumGPUBlocks: 1 << 20,
		Segments: []messages.Segment{{Shm: "s"}}, Groups: []messages.GroupSpec{
			{Kind: "full", TokensPerBlock: 16, Regions: r}, {Kind: "full", TokensPerBlock: 16, Regions: r}}})
	if err != nil {
		b.Fatal(err)
	}
	return l
}

// decodeStream is a decoding request as the engine reports it: one tokens
// event per step, a new block and hash every 16 tokens.
func decodeStream(n int) [][]messages.Event {
	out := make([][]messages.Event, n)
	for i := range out {
		t := i + 1
		evs := []messages.Event{{Type: messages.EvTokens, Request: "r", Computed: t, Total: t + 1}}
		if t%16 == 1 {
			c := t / 16
			evs = append(evs,
				messages.Event{Type: messages.EvHashes, Request: "r", Start: c, Hashes: []messages.Hash{messages.Hash(fmt.Sprintf("%08d", c))}},
				messages.Event{Type: messages.EvBlocks, Request: "r", Group: 0, Start: c, IDs: []messages.BlockID{messages.BlockID(c + 1)}},
				messages.Event{Type: messages.EvBlocks, Request: "r", Group: 1, Start: c, IDs: []messages.BlockID{messages.BlockID(c + 1)}})
		}
		out[i] = evs
	}
	return out
}

// BenchmarkCoreOnly is the floor: the same events through sched alone, with
// no actor and no tracing code.
func BenchmarkCoreOnly(b *testing.B) {
	lay := benchLayout(b)
	stream := decodeStream(b.N)
	pool := hostpool.NewShared(1<<22*lay.MaxChunkBytes(), 0)
	r := sched.NewRequest(lay, &messages.Event{Type: messages.EvAdded, Request: "r", PromptTokens: 1, MaxOffloadTokens: -1})
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for j := range stream[i] {
			_ = r.Step(&stream[i][j])
		}
		r.Advance(pool)
	}
}

// BenchmarkActorApply drives a request actor with tracing disabled (the
// default no-op provider), with the SDK but never sampling, and with the
// SDK recording every span: "tracing costs nothing measurable when off".
func BenchmarkActorApply(b *testing.B) {
	for _, tc := range []struct {
		name string
		tp   func() trace.TracerProvider
	}{
		{"tracing=off", func() trace.TracerProvider { return noop.NewTracerProvider() }},
		{"tracing=sdk-never-sample", func() trace.TracerProvider {
			return sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.NeverSample()))
		}},
		{"tracing=sdk-recording", func() trace.TracerProvider {
			return sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(tracetest.NewSpanRecorder()))
		}},
	} {
		b.Run(tc.name, func(b *testing.B) { benchActor(b, tc.tp()) })
	}
}

// sinkActor swallows store jobs and signals when the last batch was applied.
type sinkActor struct{}

func (sinkActor) Receive(actor.Context) {}

func benchActor(b *testing.B, tp trace.TracerProvider) {
	system := actor.NewActorSystem(actor.WithLoggerFactory(func(*actor.ActorSystem) *slog.Logger {
		return slog.New(slog.NewTextHandler(io.Discard, nil))
	}))
	defer system.Shutdown()
	lay := benchLayout(b)
	sink := system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return sinkActor{} }))
	deps := request.Deps{Engine: "e", Layout: lay, Store: benchStore{hostpool.NewShared(1<<22*lay.MaxChunkBytes(), 0)},
		Transfer: sink, Metrics: request.NewMetrics(metrics.NewEvents(nil), metrics.NewStore(nil), metrics.NewActors(nil)), Tracer: tp.Tracer("bench"),
		Log: slog.New(slog.NewTextHandler(io.Discard, nil)), Timers: actors.NewTimers(system.Root, nil)}
	defer deps.Timers.Stop()
	pid := request.NewSpawner().Spawn(system.Root, &deps, &messages.Event{Type: messages.EvAdded, Request: "r",
		PromptTokens: 1, MaxOffloadTokens: -1}, context.Background())
	stream := decodeStream(b.N)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		system.Root.Send(pid, &request.Events{Events: stream[i]})
	}
	// The status answer comes after every Events message was applied.
	done := make(chan struct{})
	waiter := system.Root.Spawn(actor.PropsFromFunc(func(c actor.Context) {
		if _, ok := c.Message().(*request.Status); ok {
			close(done)
		}
	}))
	system.Root.Send(pid, &request.StatusQuery{ReplyTo: waiter})
	select {
	case <-done:
	case <-time.After(time.Minute):
		b.Fatal("request actor did not drain its mailbox")
	}
}

// benchStore prepares in a real pool; its copies never run (the transfer
// actor is a sink).
type benchStore struct{ *hostpool.Shared }

func (benchStore) Copy(backend.Direction, []sched.JobChunk, func() error) error { return nil }
func (benchStore) Abort(backend.Direction, []sched.JobChunk)                    {}
