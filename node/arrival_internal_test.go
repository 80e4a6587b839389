package node

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/internal/testkit"
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
		b.Done()
	}
}

// A batch's arrival is when intake took it, not when its worker got to it:
// the time it waits behind a slow turn counts in the store latency metrics
// (decision_seconds, stored_seconds), as it counts for the engine.
func TestABatchArrivesWhenTakenNotWhenItsWorkerIsFree(t *testing.T) {
	n, err := Start(context.Background(), Config{NATSPort: -1, NATSStoreDir: t.TempDir(), HTTPAddr: HTTPOff,
		ShmDir: t.TempDir(), PoolBytes: 1 << 20, Registry: prometheus.NewRegistry(),
		Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)
	t.Cleanup(func() { _ = n.Close(context.Background()) })

	s := &stuck{release: make(chan struct{}), arrived: make(chan time.Time, 2)}
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
	size := msgBytes(&nats.Msg{Subject: subject, Data: b.Body(nil, "ep", 1)})
	testkit.Eventually(t, 10*time.Second, time.Millisecond, func() error {
		if got := n.ingest.pending.Load(); got != 2*size {
			return fmt.Errorf("intake holds %d bytes, want both batches (%d)", got, 2*size)
		}
		return nil
	})
	freed := time.Now()
	close(s.release)
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
