package engine_test

import (
	"context"
	"encoding/json"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/sched"
	"github.com/kvactors/kvactors/store"
)

// failing is engine e1 whose actor panics in the next session message's
// turn (Batch, Heartbeat, Lost, Lapsed, Tick: lapse reads Deps.Session
// first) once arm is set, or in every one once always is; its requests'
// store jobs go to jobs and stay in flight until the test ends them; its
// Failed reports come to reports.
type failing struct {
	system  *actor.ActorSystem
	pid     *actor.PID
	m       *metrics.Metrics
	jobs    chan *transfer.Submit
	closed  chan struct{}
	arm     atomic.Bool
	always  atomic.Bool
	reports chan failReport
	// nowFails makes that many Deps.Now calls panic (a Touch's turn reads
	// it: a failure in a message unrelated to the session); nowGate, when
	// set, holds the next Now call (nowEntered says it came) until closed.
	nowFails   atomic.Int64
	nowGate    atomic.Pointer[chan struct{}]
	nowEntered chan struct{}
}

type failReport struct {
	self     *actor.PID
	released <-chan int
}

func startFailing(t *testing.T, nc *nats.Conn, edit ...func(*engine.Deps)) *failing {
	t.Helper()
	f := &failing{jobs: make(chan *transfer.Submit, 16), closed: make(chan struct{}), reports: make(chan failReport, 2),
		nowEntered: make(chan struct{}, 1)}
	f.system, f.pid, f.m, _ = startEngineDeps(t, nc, f.closed,
		func(system *actor.ActorSystem, lay *sched.Layout, d *request.Deps) {
			d.Store = store.New(testkit.HeapArena(make([]byte, 64*8)), 8, nil, metrics.NewPool(nil)).
				Engine("e1", lay, testkit.NopDevice{})
			d.Transfer = system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return &submits{ch: f.jobs} }))
		}, func(d *engine.Deps) {
			d.Session = func() uint64 {
				if f.always.Load() || f.arm.CompareAndSwap(true, false) {
					panic("engine actor failure injected")
				}
				return 0
			}
			d.Now = func() time.Time {
				if g := f.nowGate.Swap(nil); g != nil {
					f.nowEntered <- struct{}{}
					<-*g
				}
				if f.nowFails.Add(-1) >= 0 {
					panic("engine actor failure injected (Now)")
				}
				return time.Now()
			}
			d.Failed = func(_ string, self *actor.PID, released <-chan int) {
				f.reports <- failReport{self: self, released: released}
			}
			for _, e := range edit {
				e(d)
			}
		})
	return f
}

// storeInFlight sends request r with one chunk ready to store (batch 1) and
// returns its store job, which stays in flight (r waits for it) until the
// test answers it.
func (f *failing) storeInFlight(t *testing.T) *transfer.Submit {
	t.Helper()
	sendBatch(f.system, f.pid, 1, readyChunk("r", 1)...)
	return testkit.Recv(t, f.jobs, 5*time.Second, "r's store job")
}

func recvRelease(t *testing.T, ch <-chan *nats.Msg, what string) messages.Released {
	t.Helper()
	var rel messages.Released
	require.NoError(t, json.Unmarshal(testkit.Recv(t, ch, 5*time.Second, what).Data, &rel))
	return rel
}

// An engine actor that panics mid-turn (a bug, a poisoned message) is not
// restarted with fresh state: it ends its engine as an unregister does
// (PROTOCOL.md "P.E.unregister"). Every request gets exactly one released,
// engine_gone, a request with a copy in flight only once that copy is done;
// the node is told (Deps.Failed, with the retire's count) so it forgets the
// engine; later batches are handled (their credit returned) but not
// applied; the actor stops, leaving the live-engines gauge, and the failure
// is counted once.
func TestAFailedEngineActorEndsItsEngineAsOnUnregister(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	f := startFailing(t, nc)
	j := f.storeInFlight(t)
	sendBatch(f.system, f.pid, 2, added("q"))
	statusOf(t, f.system, f.pid)
	require.Equal(t, 1.0, testutil.ToFloat64(f.m.EnginesLive))

	f.arm.Store(true)
	sendBatch(f.system, f.pid, 3, tokens("q", 4)) // the actor fails in this turn
	var after atomic.Bool
	f.system.Root.Send(f.pid, &engine.Batch{Batch: messages.EventBatch{Epoch: "a", Seq: 4,
		Events: []messages.Event{added("late")}}, Done: actors.SignalFunc(func() { after.Store(true) })})

	rep := testkit.Recv(t, f.reports, 5*time.Second, "the failed actor's report to its node")
	require.True(t, rep.self.Equal(f.pid), "the report names the failed actor")
	require.NotNil(t, rep.released, "the actor retired itself: its count comes to the node")
	require.Equal(t, messages.Released{Request: "q", Epoch: "a", RSeq: 1, Reason: messages.ReasonEngineGone},
		recvRelease(t, released, "q's release"))
	require.NoError(t, nc.Flush())
	testkit.NoRecv(t, released, 50*time.Millisecond, "r released while its copy is in flight")

	require.NoError(t, j.Store.Copy(j.Dir, j.Chunks, nil))
	f.system.Root.Send(j.Owner, &transfer.JobDone{ID: j.ID})
	require.Equal(t, messages.Released{Request: "r", Epoch: "a", RSeq: 2, Reason: messages.ReasonEngineGone},
		recvRelease(t, released, "r's release once its copy is done"))
	testkit.Closed(t, f.closed, 5*time.Second, "the failed engine's actor to stop")
	require.Equal(t, 2, testkit.Recv(t, rep.released, 5*time.Second, "the retire's count"))
	require.True(t, after.Load(), "a batch after the failure was handled (its credit returned)")
	require.NoError(t, nc.Flush())
	testkit.NoRecv(t, released, 50*time.Millisecond, "a second release, or one of the late request")
	require.Zero(t, testutil.ToFloat64(f.m.EnginesLive))
	require.Equal(t, 1.0, testutil.ToFloat64(f.m.Engines.Failures))
	testkit.NoRecv(t, f.reports, 10*time.Millisecond, "a second report")
}

// An engine actor that fails again while it ends its engine (here in a
// message unrelated to the end: its clock panics in a Touch's turn) is
// resumed again, not stopped: its requests are still released engine_gone,
// each once its copies in flight are done, and only then does Closed close
// (the node unmaps the device). The failure is counted once.
func TestAnEngineActorFailingAgainWhileItEndsGoesOnEnding(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	f := startFailing(t, nc)
	j := f.storeInFlight(t)
	statusOf(t, f.system, f.pid)

	f.arm.Store(true)
	f.system.Root.Send(f.pid, &engine.Tick{}) // fails; the actor begins to end
	rep := testkit.Recv(t, f.reports, 5*time.Second, "the failed actor's report")
	f.nowFails.Store(3)
	for range 3 {
		f.system.Root.Send(f.pid, &engine.Touch{}) // fails again while r's copy holds the end
	}
	f.system.Root.Send(f.pid, &engine.Tick{}) // no lapse looked at: the engine is ending
	statusOf(t, f.system, f.pid)
	require.NoError(t, nc.Flush())
	testkit.NoRecv(t, released, 50*time.Millisecond, "r released while its copy is in flight")
	select {
	case <-f.closed:
		t.Fatal("Closed closed while r's copy is in flight")
	default:
	}

	require.NoError(t, j.Store.Copy(j.Dir, j.Chunks, nil))
	f.system.Root.Send(j.Owner, &transfer.JobDone{ID: j.ID})
	require.Equal(t, messages.Released{Request: "r", Epoch: "a", RSeq: 1, Reason: messages.ReasonEngineGone},
		recvRelease(t, released, "r's release once its copy is done"))
	testkit.Closed(t, f.closed, 5*time.Second, "the engine actor's stop once its requests were released")
	require.Equal(t, 1, testkit.Recv(t, rep.released, 5*time.Second, "the retire's count"))
	require.Zero(t, testutil.ToFloat64(f.m.EnginesLive))
	require.Equal(t, 1.0, testutil.ToFloat64(f.m.Engines.Failures))
	require.Zero(t, testutilValue(f.m), "no request actor failed")
	require.NoError(t, nc.Flush())
	testkit.NoRecv(t, released, 50*time.Millisecond, "a second release of r")
}

// Past a bound of failed turns while it ends, the engine actor stops (its
// last resort). A request released engine_gone whose Done still waits in
// the mailbox when it stops (the stop goes first) is counted as the
// retire's release, not as a request failure.
func TestAnEngineActorFailingTooOftenStopsCountingReleasedRequestsRight(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	f := startFailing(t, nc)
	j := f.storeInFlight(t)
	statusOf(t, f.system, f.pid)

	f.arm.Store(true)
	f.system.Root.Send(f.pid, &engine.Tick{}) // fails; the actor begins to end
	rep := testkit.Recv(t, f.reports, 5*time.Second, "the failed actor's report")
	statusOf(t, f.system, f.pid)

	gate := make(chan struct{})
	f.nowGate.Store(&gate)
	f.system.Root.Send(f.pid, &engine.Touch{}) // holds the actor in its turn
	testkit.Recv(t, f.nowEntered, 5*time.Second, "the held turn")
	for range 10 {
		f.system.Root.Send(f.pid, &engine.Touch{})
	}
	require.NoError(t, j.Store.Copy(j.Dir, j.Chunks, nil))
	f.system.Root.Send(j.Owner, &transfer.JobDone{ID: j.ID}) // r is released; its Done queues behind the Touches
	require.Equal(t, messages.ReasonEngineGone, recvRelease(t, released, "r's release once its copy is done").Reason)
	f.nowFails.Store(11) // the held turn and each Touch after it fail
	close(gate)
	testkit.Closed(t, f.closed, 5*time.Second, "the stop of the engine actor failing again and again")
	require.Equal(t, 1, testkit.Recv(t, rep.released, 5*time.Second, "the retire's count"))
	require.Zero(t, testutilValue(f.m), "r, released and stopped with its engine actor, did not fail")
	require.Zero(t, testutil.ToFloat64(f.m.EnginesLive))
	require.NoError(t, nc.Flush())
	testkit.NoRecv(t, released, 50*time.Millisecond, "a second release of r")
}

// panicsOn is a log handler that discards records but panics on one
// message: a failure inside the engine actor's own end.
type panicsOn struct{ msg string }

func (h panicsOn) Enabled(context.Context, slog.Level) bool { return true }
func (h panicsOn) Handle(_ context.Context, r slog.Record) error {
	if r.Message == h.msg {
		panic("log handler failure injected: " + h.msg)
	}
	return nil
}
func (h panicsOn) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h panicsOn) WithGroup(string) slog.Handler      { return h }

// An engine actor that fails again inside its own end (here its log
// handler panics on the failure line, before the retire) has told its node
// first: the node forgets the engine (heartbeats answered "unknown
// engine", no more batches or credit lent to it, segments unmapped, claim
// given up) however the end goes on.
func TestAnEngineActorFailingInsideItsEndStillTellsItsNode(t *testing.T) {
	_, nc := testkit.NATS(t)
	f := startFailing(t, nc, func(d *engine.Deps) {
		d.Log = slog.New(panicsOn{msg: "engine actor failed; ending the engine as on unregister"})
	})
	f.storeInFlight(t)
	statusOf(t, f.system, f.pid)

	f.arm.Store(true)
	f.system.Root.Send(f.pid, &engine.Tick{}) // fails; its end fails too
	rep := testkit.Recv(t, f.reports, 5*time.Second, "the failed actor's report to its node")
	require.True(t, rep.self.Equal(f.pid), "the report names the failed actor")
	testkit.Closed(t, f.closed, 5*time.Second, "the stop of the engine actor that failed inside its end")
	testkit.NoRecv(t, f.reports, 10*time.Millisecond, "a second report")
}

// An unregister whose Retire reaches the engine actor after its failure
// began the same end (engine_gone) is told how many requests that end
// released (PROTOCOL.md "P.E.unregister": released N), not 0: it is the
// engine's real end.
func TestAnUnregisterAfterAFailureIsToldTheEndsCount(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	f := startFailing(t, nc)
	j := f.storeInFlight(t)
	sendBatch(f.system, f.pid, 2, added("q"))
	statusOf(t, f.system, f.pid)

	f.arm.Store(true)
	f.system.Root.Send(f.pid, &engine.Tick{}) // fails; the actor begins to end
	later := make(chan int, 1)
	f.system.Root.Send(f.pid, &engine.Retire{Reason: messages.ReasonEngineGone, Reset: later}) // the unregister's
	rep := testkit.Recv(t, f.reports, 5*time.Second, "the failed actor's report")
	require.Equal(t, "q", recvRelease(t, released, "q's release").Request)
	require.NoError(t, j.Store.Copy(j.Dir, j.Chunks, nil))
	f.system.Root.Send(j.Owner, &transfer.JobDone{ID: j.ID})
	require.Equal(t, "r", recvRelease(t, released, "r's release").Request)
	testkit.Closed(t, f.closed, 5*time.Second, "the failed engine's actor to stop")
	require.Equal(t, 2, testkit.Recv(t, later, 5*time.Second, "the unregister's count"))
	require.Equal(t, 2, testkit.Recv(t, rep.released, 5*time.Second, "the failure's own count"))
}

// records sends the records logged with one message to ch.
type records struct {
	msg string
	ch  chan slog.Record
}

func (h records) Enabled(context.Context, slog.Level) bool { return true }
func (h records) Handle(_ context.Context, r slog.Record) error {
	if r.Message == h.msg {
		h.ch <- r.Clone()
	}
	return nil
}
func (h records) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h records) WithGroup(string) slog.Handler      { return h }

// The guardian logs an engine actor's panic with the stack of the turn that
// panicked (it runs inside the mailbox's recover, on the panicking
// goroutine, before the stack unwinds): here the engine actor's lapse, where
// Deps.Session panicked, in a turn run on the actor's loop (a Tick) and in
// one run inline on the poster (a Batch).
func TestAnEngineActorsFailureIsLoggedWithItsStack(t *testing.T) {
	_, nc := testkit.NATS(t)
	for _, msg := range []any{&engine.Tick{}, &engine.Batch{Batch: messages.EventBatch{Epoch: "a", Seq: 1}}} {
		logged := make(chan slog.Record, 4)
		system := actor.NewActorSystem(actor.WithLoggerFactory(func(*actor.ActorSystem) *slog.Logger {
			return slog.New(records{msg: "engine actor failed; resumed to end its engine", ch: logged})
		}))
		var armed atomic.Bool
		_, pid, _, _ := startEngineOn(t, system, nc, make(chan struct{}),
			func(_ *actor.ActorSystem, _ *sched.Layout, _ *request.Deps) {}, func(d *engine.Deps) {
				d.Session = func() uint64 {
					if armed.CompareAndSwap(true, false) {
						panic("engine actor failure injected")
					}
					return 0
				}
			})
		armed.Store(true)
		system.Root.Send(pid, msg)
		r := testkit.Recv(t, logged, 5*time.Second, "the guardian's failure log")
		var stack string
		r.Attrs(func(a slog.Attr) bool {
			if a.Key == "stack" {
				stack = a.Value.String()
			}
			return true
		})
		require.Contains(t, stack, "engine.(*Actor).lapse", "the stack of the %T turn that panicked", msg)
	}
}
