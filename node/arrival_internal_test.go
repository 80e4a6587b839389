package node

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/tracing"
	"github.com/kvactors/kvactors/wire"
)

// stuck stands in for an engine actor whose turn takes long: its first
// batch runs inline on the intake worker (as an engine actor's does) and
// holds it until the test lets go, so the next batch waits in the worker's
// queue.
type stuck struct {
	release chan struct{}
	arrived chan time.Time
}

func (s *stuck) Receive(c actor.Context) {
	if b, ok := c.Message().(*engine.Batch); ok {
		s.arrived <- b.Arrived
		if b.Batch.Seq == 1 {
			<-s.release
		}
		b.Done.Signal()
	}
}

// A batch's arrival is when intake took it, not when its worker got to it:
// the time it waits behind a slow turn counts in the store latency metrics
// (decision_seconds, stored_seconds), as it counts for the engine.
func TestABatchArrivesWhenTakenNotWhenItsWorkerIsFree(t *testing.T) {
	t.Parallel()
	n, err := Start(context.Background(), Config{NATSPort: -1, NATSStoreDir: t.TempDir(), HTTPAddr: HTTPOff,
		ShmDir: t.TempDir(), PoolBytes: 1 << 20, Registry: prometheus.NewRegistry(),
		Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)
	t.Cleanup(func() { _ = n.Close(context.Background()) })

	s := &stuck{release: make(chan struct{}), arrived: make(chan time.Time, 2)}
	var letGo sync.Once
	free := func() { letGo.Do(func() { close(s.release) }) }
	t.Cleanup(free) // before the node's Close, which would wait for the held worker
	_, nc, subject := routeStandIn(t, n, "slow", actor.PropsFromProducer(func() actor.Actor { return s },
		actor.WithMailbox(actors.InlineMailbox)))
	var b wire.Batch
	b.Added("r1", 16)
	require.NoError(t, nc.Publish(subject, b.Body(nil, "ep", 1)))
	var first time.Time
	select {
	case first = <-s.arrived: // the worker now holds batch 1
	case <-time.After(10 * time.Second):
		t.Fatal("the first batch never reached the actor")
	}
	require.NoError(t, nc.Publish(subject, b.Body(nil, "ep", 2)))
	require.NoError(t, nc.Flush())
	// Batch 1 counts decoded (the worker decoded it), batch 2 as it came.
	want := creditOf(t, n, "slow", subject, b.Body(nil, "ep", 1)) +
		msgBytes(&nats.Msg{Subject: subject, Data: b.Body(nil, "ep", 2)})
	testkit.Eventually(t, 10*time.Second, time.Millisecond, func() error {
		if got := n.ingest.pending.Load(); got != want {
			return fmt.Errorf("intake holds %d bytes, want both batches (%d)", got, want)
		}
		return nil
	})
	freed := time.Now()
	free()
	var second time.Time
	select {
	case second = <-s.arrived:
	case <-time.After(10 * time.Second):
		t.Fatal("the second batch never reached the actor")
	}
	require.False(t, first.IsZero())
	require.True(t, second.Before(freed), "batch 2 arrived %v, after its worker was freed at %v: its queue wait is not counted",
		second, freed)
	// kvactors_ingest_wait_seconds has both batches, batch 2's wait at
	// least from its arrival to its worker being freed.
	var h dto.Metric
	require.NoError(t, n.metrics.IntakeWait.Write(&h))
	require.Equal(t, uint64(2), h.GetHistogram().GetSampleCount())
	require.GreaterOrEqual(t, h.GetHistogram().GetSampleSum(), freed.Sub(second).Seconds())
}

// A load's span starts when intake took the load, not when its worker got
// to it: the wait behind the engine's earlier messages is in the engine's
// wait for the reply, so it is in the span too.
func TestALoadsSpanStartsWhenItWasTaken(t *testing.T) {
	t.Parallel()
	rec := tracetest.NewSpanRecorder()
	n, err := Start(context.Background(), Config{NATSPort: -1, NATSStoreDir: t.TempDir(), HTTPAddr: HTTPOff,
		ShmDir: t.TempDir(), PoolBytes: 1 << 20, Registry: prometheus.NewRegistry(),
		Tracer: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec)),
		Log:    slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)
	t.Cleanup(func() { _ = n.Close(context.Background()) })

	s := &stuck{release: make(chan struct{}), arrived: make(chan time.Time, 2)}
	var freeOnce sync.Once
	free := func() { freeOnce.Do(func() { close(s.release) }) }
	t.Cleanup(free) // before Close (cleanups run last first): a failed test must not leave the worker held
	_, nc, subject := routeStandIn(t, n, "slow", actor.PropsFromProducer(func() actor.Actor { return s },
		actor.WithMailbox(actors.InlineMailbox)))
	var b wire.Batch
	b.Added("r1", 16)
	batch := b.Body(nil, "ep", 1)
	require.NoError(t, nc.Publish(subject, batch))
	select {
	case <-s.arrived: // the worker now holds the batch
	case <-time.After(10 * time.Second):
		t.Fatal("the batch never reached the actor")
	}
	// What intake holds for the batch now: its decoded size where larger
	// than its wire size (credit), admitted before the actor got it. Its
	// wire size alone was passed as soon as the decoded extra was counted,
	// before the load had come, and the load's span then started after
	// the mark below.
	held := n.ingest.pending.Load()
	replies, err := nc.SubscribeSync(messages.InboxRoot + "slow." + nats.NewInbox()[len(nats.InboxPrefix):]) // the engine's own inbox
	require.NoError(t, err)
	loadSubject := n.cfg.Prefix + ".slow." + messages.VerbLoad
	require.NoError(t, nc.PublishRequest(loadSubject, replies.Subject, []byte(`{"request":"r1"}`)))
	require.NoError(t, nc.Flush())
	testkit.Eventually(t, 10*time.Second, time.Millisecond, func() error {
		if got := n.ingest.pending.Load(); got <= held {
			return fmt.Errorf("intake holds %d bytes, want the load beside the batch (%d)", got, held)
		}
		return nil
	})
	freed := time.Now()
	free()
	reply, err := replies.NextMsg(10 * time.Second)
	require.NoError(t, err)
	require.Contains(t, string(reply.Data), "unknown engine") // a stand-in has no engine record
	var spans []sdktrace.ReadOnlySpan
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		spans = nil
		for _, sp := range rec.Ended() {
			if sp.Name() == tracing.SpanLoad {
				spans = append(spans, sp)
			}
		}
		if len(spans) != 1 {
			return fmt.Errorf("%d load spans ended, want 1", len(spans))
		}
		return nil
	})
	require.True(t, spans[0].StartTime().Before(freed),
		"the load's span started %v, after its worker was freed at %v: its queue wait is left out", spans[0].StartTime(), freed)
	require.Equal(t, codes.Error, spans[0].Status().Code)
}
