package engine_test

import (
	"errors"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/sched"
)

func testutilValue(m *metrics.Metrics) float64 { return testutil.ToFloat64(m.RequestFailure) }

func errString(s string) error { return errors.New(s) }

// startEngine spawns engine "e1" (one full group, 4 tokens per block and
// per hash, one block per chunk) publishing on nc, its requests deciding
// against store (nil: their first store decision dereferences a nil pool),
// their retries delivered by timers (the engine stops it when it stops).
func startEngine(t *testing.T, nc *nats.Conn, closed chan struct{}, store request.Store) (*actor.ActorSystem, *actor.PID, *metrics.Metrics, *actors.Timers) {
	t.Helper()
	return startEngineWith(t, nc, closed, func(_ *actor.ActorSystem, _ *sched.Layout, d *request.Deps) { d.Store = store })
}

// startEngineWith is startEngine with the requests' deps set by edit, which
// gets the system and the engine's layout.
func startEngineWith(t *testing.T, nc *nats.Conn, closed chan struct{},
	edit func(*actor.ActorSystem, *sched.Layout, *request.Deps)) (*actor.ActorSystem, *actor.PID, *metrics.Metrics, *actors.Timers) {
	t.Helper()
	return startEngineDeps(t, nc, closed, edit, nil)
}

// startEngineDeps is startEngineWith with the engine's own deps set by
// editEngine (nil: none).
func startEngineDeps(t *testing.T, nc *nats.Conn, closed chan struct{},
	edit func(*actor.ActorSystem, *sched.Layout, *request.Deps),
	editEngine func(*engine.Deps)) (*actor.ActorSystem, *actor.PID, *metrics.Metrics, *actors.Timers) {
	t.Helper()
	return startEngineOn(t, actor.NewActorSystem(), nc, closed, edit, editEngine)
}

// startEngineOn is startEngineDeps on system (shut down when the test ends).
func startEngineOn(t *testing.T, system *actor.ActorSystem, nc *nats.Conn, closed chan struct{},
	edit func(*actor.ActorSystem, *sched.Layout, *request.Deps),
	editEngine func(*engine.Deps)) (*actor.ActorSystem, *actor.PID, *metrics.Metrics, *actors.Timers) {
	t.Helper()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	lay, err := sched.NewLayout(&messages.EngineSpec{TokensPerHash: 4, BlocksPerChunk: 1, NumGPUBlocks: 64,
		Segments: []messages.Segment{{Shm: "x"}},
		Groups: []messages.GroupSpec{{Kind: "full", TokensPerBlock: 4,
			Regions: []messages.Region{{BlockStride: 8, BlockBytes: 8}}}}})
	require.NoError(t, err)
	m := metrics.Discard()
	outbox := actors.NewOutbox(nc, "kvactors", log)
	t.Cleanup(system.Shutdown)
	timers := actors.NewTimers(system.Root, nil)
	t.Cleanup(timers.Stop) // the engine stops it too, if it stops
	rd := request.Deps{Engine: "e1", Layout: lay, Outbox: outbox,
		Metrics: request.NewMetrics(m.Events, m.Store, m.Actors),
		Tracer:  noop.NewTracerProvider().Tracer(""), Log: log, Timers: timers}
	edit(system, lay, &rd)
	ed := engine.Deps{Engine: "e1", Outbox: outbox,
		Metrics: engine.NewMetrics(m.Engines, m.Events, m.Store, m.Actors), Log: log,
		Releases: actors.NewReleases(outbox, "e1"), Lease: time.Minute, Closed: closed, Request: rd}
	if editEngine != nil {
		editEngine(&ed)
	}
	pid := system.Root.Spawn(engine.Props(ed))
	return system, pid, m, timers
}

// oneWorkerTransfer gives d a transfer actor on system with one copy
// worker (a second copy waits in the queue) and its queue, which it
// returns.
func oneWorkerTransfer(system *actor.ActorSystem, d *request.Deps) *transfer.Queue {
	cfg := transfer.Config{Workers: 1}
	q := transfer.NewQueue(cfg, nil)
	d.Queue = q
	d.Transfer = system.Root.Spawn(transfer.Props(transfer.Deps{Config: cfg, Metrics: metrics.NewTransfer(nil),
		Tracer: noop.NewTracerProvider().Tracer(""), Log: slog.New(slog.NewTextHandler(io.Discard, nil)), Queue: q}))
	return q
}
