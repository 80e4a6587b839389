package engine_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// panicsOnReleasedEvent is a tracer whose spans record and panic on the
// "released" event: a failure in a request actor's final release, just
// after the publish.
type panicsOnReleasedEvent struct{ trace.Tracer }

func (p panicsOnReleasedEvent) Start(ctx context.Context, name string, opts ...trace.SpanStartOption) (context.Context, trace.Span) {
	ctx, s := p.Tracer.Start(ctx, name, opts...)
	return ctx, panicsOnReleasedSpan{s}
}

type panicsOnReleasedSpan struct{ trace.Span }

func (panicsOnReleasedSpan) IsRecording() bool { return true }

func (s panicsOnReleasedSpan) AddEvent(name string, opts ...trace.EventOption) {
	if name == "released" {
		panic("span event failure injected")
	}
	s.Span.AddEvent(name, opts...)
}

// A request actor that fails right after its final release went out (here,
// in the span event that follows the publish) has raised its releasing
// flag: the engine takes it for a request that failed after its release.
// It is released once (its own release), the release is counted once, its
// owed count comes back to zero, and the failure is counted. (Counted and
// traced before the publish, a failure there left the flag down, and the
// engine's own aborted release was counted a second time.)
func TestARequestFailingAfterItsFinalPublishIsReleasedOnce(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	var owed atomic.Int64
	system, pid, m, _ := startEngineWith(t, nc, make(chan struct{}), func(_ *actor.ActorSystem, _ *sched.Layout, d *request.Deps) {
		d.Owed = &owed
		d.Tracer = panicsOnReleasedEvent{noop.NewTracerProvider().Tracer("")}
	})
	sendBatch(system, pid, 1, added("r"), messages.Event{Type: messages.EvFinished, Request: "r", Computed: 0, Total: 8})
	require.Equal(t, messages.ReasonFinished, recvRelease(t, released, "r's own release").Reason)
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if testutilValue(m) != 1 {
			return errString("r's failure not counted yet")
		}
		if n := owed.Load(); n != 0 {
			return errString("r still owed")
		}
		return nil
	})
	require.NoError(t, nc.Flush())
	testkit.NoRecv(t, released, 50*time.Millisecond, "a second release of r")
	require.Equal(t, 1.0, testutil.ToFloat64(m.Store.Release(messages.ReasonFinished)), "r's release counted once")
	require.Zero(t, testutil.ToFloat64(m.Store.Release(messages.ReasonAborted)))
}

// A retire counts a request that released with its reason and then failed
// (here in the span event just after the publish) as it counts one whose
// Done came: the unregister's "released" is the releases the engine got.
// (Counted only through Done, or through a Terminated while the engine
// stopped, it came out one short.)
func TestARetireCountsARequestThatFailedAfterItsRelease(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	closed := make(chan struct{})
	system, pid, m, _ := startEngineWith(t, nc, closed, func(_ *actor.ActorSystem, _ *sched.Layout, d *request.Deps) {
		d.Tracer = panicsOnReleasedEvent{noop.NewTracerProvider().Tracer("")}
	})
	sendBatch(system, pid, 1, added("r"))
	statusOf(t, system, pid)
	count := make(chan int, 1)
	system.Root.Send(pid, &engine.Retire{Reason: messages.ReasonEngineGone, Reset: count})
	require.Equal(t, messages.ReasonEngineGone, recvRelease(t, released, "r's release").Reason)
	require.Equal(t, 1, testkit.Recv(t, count, 5*time.Second, "the retire's count"))
	testkit.Closed(t, closed, 5*time.Second, "the retired engine's stop")
	require.Equal(t, 1.0, testutilValue(m), "r's failure counted")
}
