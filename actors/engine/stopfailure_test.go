package engine_test

import (
	"io"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/sched"
)

// panicsOnDec is a gauge whose Dec panics: a failure in the engine actor's
// last turn (Stopped), where it leaves the live-engines gauge.
type panicsOnDec struct{ prometheus.Gauge }

func (panicsOnDec) Dec() { panic("gauge failure injected") }

// A panic in the engine actor's last turn (Stopped) comes after protoactor
// removed the actor: no turn follows it. Closed closes all the same (the
// node unmaps the device and gives up its claim once it does), and the
// failure is counted.
func TestClosedClosesWhenTheEngineActorsLastTurnPanics(t *testing.T) {
	_, nc := testkit.NATS(t)
	closed := make(chan struct{})
	system, pid, m, _ := startEngineDeps(t, nc, closed, func(*actor.ActorSystem, *sched.Layout, *request.Deps) {},
		func(d *engine.Deps) {
			e := *d.Metrics.Engines
			e.EnginesLive = panicsOnDec{e.EnginesLive}
			d.Metrics.Engines = &e
		})
	statusOf(t, system, pid)
	count := make(chan int, 1)
	system.Root.Send(pid, &engine.Retire{Reason: messages.ReasonEngineGone, Reset: count})
	require.Equal(t, 0, testkit.Recv(t, count, 5*time.Second, "the retire's count"))
	testkit.Closed(t, closed, 5*time.Second, "Closed, after a panic in the engine actor's Stopped turn")
	require.Equal(t, 1.0, testutil.ToFloat64(m.Failures))
}

// A panic in a request actor's Terminated while the engine actor stops
// (its last resort: it failed inside its own end) would keep protoactor
// from finishing the stop: Closed would never close. It is recovered and
// counted, and the stop goes on.
func TestClosedClosesWhenARequestsEndPanicsWhileTheEngineActorStops(t *testing.T) {
	_, nc := testkit.NATS(t)
	f := startFailing(t, nc, func(d *engine.Deps) {
		d.Log = slog.New(panicsOn{msg: "engine actor failed; ending the engine as on unregister"})
		release := d.Metrics.Release
		d.Metrics.Release = func(reason string) prometheus.Counter {
			if reason == messages.ReasonAborted {
				panic("release counter failure injected")
			}
			return release(reason)
		}
	})
	f.storeInFlight(t)
	statusOf(t, f.system, f.pid)
	f.arm.Store(true)
	f.system.Root.Send(f.pid, &engine.Tick{}) // fails, and fails again in its end: it stops
	testkit.Recv(t, f.reports, 5*time.Second, "the failed actor's report")
	testkit.Closed(t, f.closed, 5*time.Second, "Closed, after a panic in a request's end while the engine actor stopped")
	require.Equal(t, 1.0, testutil.ToFloat64(f.m.Failures), "the engine's failure, counted once")
}

// A panic in Stopping, while the engine actor hands off a failed request
// that waits for its copies (handOffDraining), would keep protoactor from
// stopping the children and finishing the stop: Closed would never close.
// It is recovered and counted, and the stop goes on.
func TestClosedClosesWhenAHandOffPanicsWhileTheEngineActorStops(t *testing.T) {
	_, nc := testkit.NATS(t)
	closed := make(chan struct{})
	fs := &faultyStore{}
	h := &holdsDrains{jobs: make(chan *transfer.Submit, 8), drains: make(chan *transfer.Drain, 8)}
	var always, panicRelease atomic.Bool
	system, pid, m, _ := startEngineDeps(t, nc, closed, func(system *actor.ActorSystem, lay *sched.Layout, d *request.Deps) {
		fs.over(lay)
		d.Store = fs
		d.Transfer = system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return h }))
	}, func(d *engine.Deps) {
		d.Session = func() uint64 {
			if always.Load() {
				panic("engine actor failure injected")
			}
			return 0
		}
		d.Log = slog.New(panicsOn{msg: "engine actor failed; ending the engine as on unregister"})
		release := d.Metrics.Release
		d.Metrics.Release = func(reason string) prometheus.Counter {
			if reason == messages.ReasonAborted && panicRelease.Load() {
				panic("release counter failure injected")
			}
			return release(reason)
		}
	})
	sendBatch(system, pid, 1, append([]messages.Event{added("r")}, chunk("r", 0)...)...)
	testkit.Recv(t, h.jobs, 5*time.Second, "r's store job") // stays in flight
	fs.arm.Store(true)
	sendBatch(system, pid, 2, chunk("r", 1)...) // r fails; its release waits for Drained
	testkit.Recv(t, h.drains, 5*time.Second, "the engine's Drain for r")

	panicRelease.Store(true)
	always.Store(true)
	system.Root.Send(pid, &engine.Tick{}) // the engine actor fails, and fails again in its end: it stops
	testkit.Closed(t, closed, 5*time.Second, "Closed, after a panic in the engine actor's Stopping")
	require.Equal(t, 1.0, testutil.ToFloat64(m.Failures), "the engine's failure, counted once")
}

// panicsOnInc is a counter whose Inc panics: a failure inside a handed-off
// release (the aborted release counter, counted before the publish).
type panicsOnInc struct{ prometheus.Counter }

func (panicsOnInc) Inc() { panic("release counter failure injected") }

// A handed-off release that panics (its counter, in a last-resort stop,
// run by the copy queue) loses that release, but not Closed: the end it
// counted is given back all the same, so the node still unmaps the device
// and gives up its claim. The panic is counted as a Then failure.
func TestClosedClosesWhenAHandedOffReleasePanics(t *testing.T) {
	_, nc := testkit.NATS(t)
	closed := make(chan struct{})
	tm := metrics.NewTransfer(nil)
	var armed atomic.Bool
	system, pid, _, _ := startEngineDeps(t, nc, closed, func(system *actor.ActorSystem, _ *sched.Layout, d *request.Deps) {
		cfg := transfer.Config{Workers: 1}
		q := transfer.NewQueue(cfg, tm)
		d.Queue = q
		d.Transfer = system.Root.Spawn(transfer.Props(transfer.Deps{Config: cfg, Metrics: tm,
			Tracer: noop.NewTracerProvider().Tracer(""), Log: slog.New(slog.NewTextHandler(io.Discard, nil)), Queue: q}))
	}, func(d *engine.Deps) {
		d.Session = func() uint64 {
			if armed.CompareAndSwap(true, false) {
				panic("engine actor failure injected")
			}
			return 0
		}
		d.Log = slog.New(panicsOn{msg: "engine actor failed; ending the engine as on unregister"})
		release := d.Metrics.Release
		d.Metrics.Release = func(reason string) prometheus.Counter {
			if reason == messages.ReasonAborted {
				return panicsOnInc{release(reason)}
			}
			return release(reason)
		}
	})
	sendBatch(system, pid, 1, added("r")) // r is live, unreleased, with no copy
	statusOf(t, system, pid)

	armed.Store(true)
	system.Root.Send(pid, &engine.Tick{}) // fails, and fails again in its end: it stops; r is handed off
	testkit.Closed(t, closed, 5*time.Second, "Closed, after r's handed-off release panicked")
	require.Equal(t, 1.0, testutil.ToFloat64(tm.ThenFailures), "the lost release, counted")
}
