package engine_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// panicsOnReleasedEvent is a tracer whose spans record and panic on the
// "released" event: a failure in a request actor's final release, after
// the release counter and before the publish.
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

// A request actor that fails on its way to its final release, before the
// publish (here, its span event), has not raised its releasing flag: the
// engine releases it itself, aborted, and its owed count comes back to
// zero (raised earlier, the engine would take it for a request that failed
// after its release: no release at all, and owed for good).
func TestARequestFailingBeforeItsFinalPublishIsReleasedByItsEngine(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	var owed atomic.Int64
	system, pid, m, _ := startEngineWith(t, nc, make(chan struct{}), func(_ *actor.ActorSystem, _ *sched.Layout, d *request.Deps) {
		d.Owed = &owed
		d.Tracer = panicsOnReleasedEvent{noop.NewTracerProvider().Tracer("")}
	})
	sendBatch(system, pid, 1, added("r"), messages.Event{Type: messages.EvFinished, Request: "r", Computed: 0, Total: 8})
	require.Equal(t, messages.ReasonAborted, recvRelease(t, released, "r's release, by its engine").Reason)
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if n := owed.Load(); n != 0 {
			return errString("r still owed")
		}
		return nil
	})
	require.Equal(t, 1.0, testutilValue(m), "r's failure, counted")
}
