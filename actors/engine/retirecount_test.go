package engine_test

import (
	"context"
	"encoding/json"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/embedded"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/sched"
	"github.com/kvactors/kvactors/store"
	"github.com/kvactors/kvactors/tracing"
)

// gatedTracer's store-job spans, once armed, hold the goroutine that ends
// them until the gate opens: a request actor's turn is paused there, after
// its job's end and before it decides its final release. With panics set,
// the armed span panics instead: the request actor fails in that turn.
type gatedTracer struct {
	embedded.Tracer
	armed   atomic.Bool
	panics  bool
	holding chan struct{}
	gate    chan struct{}
}

type gatedSpan struct {
	trace.Span
	t *gatedTracer
}

func (t *gatedTracer) Start(ctx context.Context, name string, _ ...trace.SpanStartOption) (context.Context, trace.Span) {
	var s trace.Span = noop.Span{}
	if name == tracing.SpanStoreJob {
		s = gatedSpan{Span: s, t: t}
	}
	return trace.ContextWithSpan(ctx, s), s
}

func (s gatedSpan) End(...trace.SpanEndOption) {
	if s.t.armed.CompareAndSwap(true, false) {
		if s.t.panics {
			panic("request actor failure injected at its job's end")
		}
		s.t.holding <- struct{}{}
		<-s.t.gate
	}
}

// startTraced is engine e1 (closed closed when it stops) whose request
// actors trace with tr; their store jobs come to jobs.
func startTraced(t *testing.T, nc *nats.Conn, closed chan struct{}, tr *gatedTracer) (*actor.ActorSystem, *actor.PID, chan *transfer.Submit) {
	t.Helper()
	jobs := make(chan *transfer.Submit, 16)
	system, pid, _, _ := startEngineWith(t, nc, closed, func(system *actor.ActorSystem, lay *sched.Layout, d *request.Deps) {
		d.Store = store.New(testkit.HeapArena(make([]byte, 64*8)), 8, nil, metrics.NewPool(nil)).
			Engine("e1", lay, testkit.NopDevice{})
		d.Transfer = system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return &submits{ch: jobs} }))
		d.Tracer = tr
	})
	return system, pid, jobs
}

// A retire's count (unregister's "released") is the requests it released
// with its reason, counted from their Done, not at the reset: a request
// whose turn was deciding its final release (finished) when the retire
// looked at its releasing flag (still down) releases finished, ignores the
// Reset that comes after, and is not counted.
func TestARetireCountsOnlyTheReleasesItCaused(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	closed := make(chan struct{})
	tr := &gatedTracer{holding: make(chan struct{}, 1), gate: make(chan struct{})}
	t.Cleanup(func() {
		select {
		case <-tr.gate:
		default:
			close(tr.gate)
		}
	})
	system, pid, jobs := startTraced(t, nc, closed, tr)
	sendBatch(system, pid, 1, readyChunk("r", 1)...)
	j := testkit.Recv(t, jobs, 5*time.Second, "r's store job")
	sendBatch(system, pid, 2, finished("r"))
	statusOf(t, system, pid) // r has the finished event: its release waits for j

	// j ends; r's turn stops at the job span's end, its flag still down.
	tr.armed.Store(true)
	require.NoError(t, j.Store.Copy(j.Dir, j.Chunks, nil))
	go system.Root.Send(j.Owner, &transfer.JobDone{ID: j.ID})
	testkit.Recv(t, tr.holding, 5*time.Second, "r's turn held before its release")

	count := make(chan int, 1)
	system.Root.Send(pid, &engine.Retire{Reason: messages.ReasonEngineGone, Reset: count})
	statusOf(t, system, pid) // the retire was handled: r's Reset waits behind r's turn
	close(tr.gate)

	var rel messages.Released
	require.NoError(t, json.Unmarshal(testkit.Recv(t, released, 5*time.Second, "r's release").Data, &rel))
	require.Equal(t, messages.ReasonFinished, rel.Reason, "r's turn decided its release before the Reset")
	require.Zero(t, testkit.Recv(t, count, 5*time.Second, "the retire's count"), "r counted as released engine_gone")
	testkit.Closed(t, closed, 5*time.Second, "the retired engine's stop")
	require.NoError(t, nc.Flush())
	testkit.NoRecv(t, released, 50*time.Millisecond, "a second release of r")
}

// A retire whose last request actor fails (supervision stops it; the engine
// releases it aborted on its Terminated) still ends: the engine stops, its
// count (0: nothing released engine_gone) goes out, and the node can unmap.
func TestARetireEndsWhenItsLastRequestFails(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	closed := make(chan struct{})
	tr := &gatedTracer{panics: true}
	system, pid, jobs := startTraced(t, nc, closed, tr)
	sendBatch(system, pid, 1, readyChunk("r", 1)...)
	j := testkit.Recv(t, jobs, 5*time.Second, "r's store job")

	count := make(chan int, 1)
	system.Root.Send(pid, &engine.Retire{Reason: messages.ReasonEngineGone, Reset: count})
	statusOf(t, system, pid) // r is reset: its release waits for j
	tr.armed.Store(true)
	require.NoError(t, j.Store.Copy(j.Dir, j.Chunks, nil))
	system.Root.Send(j.Owner, &transfer.JobDone{ID: j.ID}) // r fails in this turn

	var rel messages.Released
	require.NoError(t, json.Unmarshal(testkit.Recv(t, released, 5*time.Second, "r's release").Data, &rel))
	require.Equal(t, messages.ReasonAborted, rel.Reason)
	testkit.Closed(t, closed, 5*time.Second, "the retired engine's stop after its last request failed")
	require.Zero(t, testkit.Recv(t, count, 5*time.Second, "the retire's count"))
}

// The count goes to the retire that reset the requests, with its reason; a
// retire that comes after it (an expiry during a shutdown's engine_reset
// retire) reset nothing and is told 0, not the first one's releases.
func TestALaterRetireIsToldItReleasedNothing(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	system, pid, jobs := startSubmitting(t, nc, nil)
	sendBatch(system, pid, 1, readyChunk("r", 1)...)
	j := testkit.Recv(t, jobs, 5*time.Second, "r's store job")

	later := make(chan int, 1)
	system.Root.Send(pid, &engine.Retire{}) // engine_reset, no count asked: as at shutdown
	system.Root.Send(pid, &engine.Retire{Reason: messages.ReasonEngineGone, Reset: later})
	statusOf(t, system, pid)
	require.NoError(t, j.Store.Copy(j.Dir, j.Chunks, nil))
	system.Root.Send(j.Owner, &transfer.JobDone{ID: j.ID}) // r's release waited for its copy
	var rel messages.Released
	require.NoError(t, json.Unmarshal(testkit.Recv(t, released, 5*time.Second, "r's release").Data, &rel))
	require.Equal(t, messages.ReasonEngineReset, rel.Reason)
	require.Zero(t, testkit.Recv(t, later, 5*time.Second, "the later retire's count"))
}
