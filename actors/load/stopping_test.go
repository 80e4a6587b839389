package load_test

import (
	"io"
	"log/slog"
	"slices"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/sched"
)

// abortStore records what Abort was given; no copy may run.
type abortStore struct {
	mu      sync.Mutex
	aborted []sched.JobChunk
	copied  int
}

func (s *abortStore) Copy(backend.Direction, []sched.JobChunk, func() error) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.copied++
	return nil
}

func (s *abortStore) Abort(_ backend.Direction, chunks []sched.JobChunk) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.aborted = append(s.aborted, chunks...)
}

// A load taken as the node stops, after its transfer actor has (the node
// stops the transfer actor before the actor system), is still answered:
// with its copy queue (Deps.Queue) the load reaches the queue, which
// refuses it, unpins its keys (Abort) and fails it; the engine gets an
// error reply naming the stop, the load is counted as an error and Done
// runs. Through the transfer actor's mailbox (the old way) the Submit
// was dropped with the stopped actor and the engine never answered.
func TestALoadTakenAsTheNodeStopsIsAnswered(t *testing.T) {
	r := newRig(t)
	q := transfer.NewQueue(transfer.Config{Workers: 1}, nil)
	xfer := r.system.Root.Spawn(transfer.Props(transfer.Deps{Config: transfer.Config{Workers: 1},
		Metrics: metrics.NewTransfer(nil), Tracer: noop.NewTracerProvider().Tracer(""),
		Log: slog.New(slog.NewTextHandler(io.Discard, nil)), Queue: q}))
	require.NoError(t, r.system.Root.StopFuture(xfer).Wait())
	r.deps.Transfer, r.deps.Queue = xfer, q

	st := &abortStore{}
	j := job(2)
	j.Store = st
	stopped := r.start(j)
	rep := r.reply()
	require.False(t, rep.OK)
	require.Contains(t, rep.Error, transfer.ErrQueueClosed.Error())
	testkit.Recv(t, stopped, wait, "the load actor stops")
	require.EqualValues(t, 1, r.done.Load())
	require.EqualValues(t, 1, r.loads("error"))
	st.mu.Lock()
	defer st.mu.Unlock()
	require.Zero(t, st.copied)
	require.True(t, slices.EqualFunc(j.Chunks, st.aborted, func(a, b sched.JobChunk) bool { return a.Key == b.Key }),
		"the load's keys are unpinned: aborted %v", st.aborted)
}
