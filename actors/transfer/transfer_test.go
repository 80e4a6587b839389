package transfer_test

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/sched"
)

// gatedDevice blocks every copy until the test releases it, and records the
// order copies started in.
type gatedDevice struct {
	mu      sync.Mutex
	started []int64 // bytes of each started copy, in order
	gate    chan struct{}
	fail    error
	// starts, when set, is told each copy's start (buffered: a start never
	// waits on it), so a test can wait for one, or check that none comes.
	starts chan struct{}
}

func (d *gatedDevice) SegmentSize(int) int64 { return 1 << 30 }
func (d *gatedDevice) Close() error          { return nil }
func (d *gatedDevice) Copy(_ backend.Direction, _ backend.Arena, r []backend.Range) error {
	d.mu.Lock()
	var n int64
	for _, x := range r {
		n += x.Len
	}
	d.started = append(d.started, n)
	d.mu.Unlock()
	if d.starts != nil {
		d.starts <- struct{}{}
	}
	<-d.gate
	return d.fail
}

func (d *gatedDevice) startedCopies() []int64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]int64(nil), d.started...)
}

// gatedStore is a transfer.Store over a gatedDevice: each copy is one
// device call of the job's block bytes; it records which chunks were
// completed (Copy returned) and aborted.
type gatedStore struct {
	dev     *gatedDevice
	mu      sync.Mutex
	copied  []messages.Key
	aborted []messages.Key
}

func (s *gatedStore) Copy(dir backend.Direction, chunks []sched.JobChunk, live func() error) error {
	var r []backend.Range
	for _, c := range chunks {
		r = append(r, backend.Range{Len: int64(100 * len(c.Blocks))})
	}
	err := s.dev.Copy(dir, nil, r)
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, c := range chunks {
		s.copied = append(s.copied, c.Key)
	}
	return err
}

func (s *gatedStore) Abort(_ backend.Direction, chunks []sched.JobChunk) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, c := range chunks {
		s.aborted = append(s.aborted, c.Key)
	}
}

func (s *gatedStore) seen() (copied, aborted []messages.Key) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.copied), slices.Clone(s.aborted)
}

// sink collects JobDone messages.
type sink struct{ ch chan *transfer.JobDone }

func (s *sink) Receive(c actor.Context) {
	if m, ok := c.Message().(*transfer.JobDone); ok {
		s.ch <- m
	}
}

func setup(t *testing.T, cfg transfer.Config) (*actor.ActorSystem, *actor.PID, *actor.PID, chan *transfer.JobDone) {
	system := actor.NewActorSystem()
	t.Cleanup(system.Shutdown)
	pid := system.Root.Spawn(transfer.Props(transfer.Deps{Config: cfg,
		Metrics: metrics.NewTransfer(nil), Tracer: noop.NewTracerProvider().Tracer(""),
		Log: slog.New(slog.NewTextHandler(io.Discard, nil))}))
	done := make(chan *transfer.JobDone, 64)
	owner := system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return &sink{ch: done} }))
	return system, pid, owner, done
}

func job(owner *actor.PID, id sched.JobID, dir backend.Direction, st transfer.Store, blocks int) *transfer.Submit {
	s := &transfer.Submit{Owner: owner, ID: id, Dir: dir, Store: st}
	for i := 0; i < blocks; i++ {
		s.Chunks = append(s.Chunks, sched.JobChunk{Key: messages.Key(fmt.Sprintf("j%d-%d", id, i)),
			Blocks: []messages.BlockID{messages.BlockID(2 * (i + 1))}})
		s.Bytes += 100
	}
	return s
}

func waitStarted(t *testing.T, d *gatedDevice, n int) {
	t.Helper()
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if got := len(d.startedCopies()); got < n {
			return fmt.Errorf("%d copies started, want %d", got, n)
		}
		return nil
	})
}

// Copies run off the mailbox on a bounded pool; queued jobs can be
// cancelled; loads go ahead of queued stores; failures are reported.
func TestWorkersBoundCancelAndLoadPriority(t *testing.T) {
	system, pid, owner, done := setup(t, transfer.Config{Workers: 1, MaxInFlightBytes: 1 << 20})
	dev := &gatedDevice{gate: make(chan struct{})}
	st := &gatedStore{dev: dev}
	system.Root.Send(pid, job(owner, 1, backend.DeviceToHost, st, 1))
	waitStarted(t, dev, 1)
	system.Root.Send(pid, job(owner, 2, backend.DeviceToHost, st, 2))
	system.Root.Send(pid, job(owner, 3, backend.DeviceToHost, st, 3))
	system.Root.Send(pid, job(owner, 4, backend.HostToDevice, st, 4))
	system.Root.Send(pid, &transfer.Cancel{Owner: owner, IDs: []sched.JobID{3}})
	select {
	case d := <-done:
		require.Equal(t, sched.JobID(3), d.ID)
		require.True(t, d.Cancelled)
	case <-time.After(5 * time.Second):
		t.Fatal("no JobDone for the cancelled job")
	}
	require.Len(t, dev.startedCopies(), 1, "one worker: nothing else started")
	dev.gate <- struct{}{} // job 1 ends; the load (4 blocks) goes before store 2
	waitStarted(t, dev, 2)
	require.Equal(t, int64(400), dev.startedCopies()[1])
	close(dev.gate)
	seen := map[sched.JobID]bool{}
	for len(seen) < 3 {
		select {
		case d := <-done:
			require.NoError(t, d.Err)
			seen[d.ID] = true
		case <-time.After(5 * time.Second):
			t.Fatalf("jobs done: %v", seen)
		}
	}
}

// A job over the in-flight bound waits until running copies finish, then
// runs alone; a failed copy reports its error.
func TestInFlightBytesBoundAndFailure(t *testing.T) {
	system, pid, owner, done := setup(t, transfer.Config{Workers: 4, MaxInFlightBytes: 250})
	dev := &gatedDevice{gate: make(chan struct{}), fail: errors.New("dma fault")}
	st := &gatedStore{dev: dev}
	system.Root.Send(pid, job(owner, 1, backend.DeviceToHost, st, 2)) // 200 bytes
	system.Root.Send(pid, job(owner, 2, backend.DeviceToHost, st, 1)) // +100 > 250: waits
	waitStarted(t, dev, 1)
	require.Len(t, dev.startedCopies(), 1)
	close(dev.gate)
	for i := 0; i < 2; i++ {
		select {
		case d := <-done:
			require.ErrorContains(t, d.Err, "dma fault")
		case <-time.After(5 * time.Second):
			t.Fatal("missing JobDone")
		}
	}
}

// The transfer side completes the pool itself, through its Store: a
// cancelled job is aborted, a copied one completed (Copy returned), before
// the owner hears JobDone (so room frees at copy speed).
func TestTransferCompletesThePool(t *testing.T) {
	system, pid, owner, done := setup(t, transfer.Config{Workers: 1, MaxInFlightBytes: 1 << 20})
	dev := &gatedDevice{gate: make(chan struct{})}
	st := &gatedStore{dev: dev}
	system.Root.Send(pid, job(owner, 1, backend.DeviceToHost, st, 1))
	waitStarted(t, dev, 1)
	system.Root.Send(pid, job(owner, 2, backend.DeviceToHost, st, 1))
	system.Root.Send(pid, &transfer.Cancel{Owner: owner, IDs: []sched.JobID{2}})
	d := testkit.Recv(t, done, 5*time.Second, "cancelled job")
	require.True(t, d.Cancelled)
	copied, aborted := st.seen()
	require.Equal(t, []messages.Key{"j2-0"}, aborted, "a cancelled store is aborted before JobDone")
	require.Empty(t, copied)
	dev.gate <- struct{}{}
	d = testkit.Recv(t, done, 5*time.Second, "store job")
	require.NoError(t, d.Err)
	copied, _ = st.seen()
	require.Equal(t, []messages.Key{"j1-0"}, copied, "a finished store is completed before JobDone")
	close(dev.gate)
	system.Root.Send(pid, job(owner, 3, backend.HostToDevice, st, 1))
	testkit.Recv(t, done, 5*time.Second, "load job")
	copied, _ = st.seen()
	require.Equal(t, []messages.Key{"j1-0", "j3-0"}, copied, "a load is completed before JobDone")
}

// A job pushed straight to the actor's queue (Queue.Submit, as request
// actors do) runs and is reported like a Submit message, and a Cancel sent
// through the mailbox afterwards still finds the jobs queued behind it.
func TestQueueSubmitSkipsTheMailboxAndCancelStillFindsIt(t *testing.T) {
	system := actor.NewActorSystem()
	t.Cleanup(system.Shutdown)
	cfg := transfer.Config{Workers: 1, MaxInFlightBytes: 1 << 20}
	gauges := metrics.NewTransfer(nil)
	q := transfer.NewQueue(cfg, gauges)
	pid := system.Root.Spawn(transfer.Props(transfer.Deps{Config: cfg, Queue: q,
		Metrics: gauges, Tracer: noop.NewTracerProvider().Tracer(""),
		Log: slog.New(slog.NewTextHandler(io.Discard, nil))}))
	done := make(chan *transfer.JobDone, 8)
	owner := system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return &sink{ch: done} }))
	dev := &gatedDevice{gate: make(chan struct{})}
	st := &gatedStore{dev: dev}
	q.Submit(job(owner, 1, backend.DeviceToHost, st, 1))
	waitStarted(t, dev, 1) // the actor's worker took it from the shared queue
	q.Submit(job(owner, 2, backend.DeviceToHost, st, 1))
	q.Submit(job(owner, 3, backend.DeviceToHost, st, 1))
	// The gauges follow the queue, not the actor's turns (none ran here).
	require.Equal(t, 2.0, testutil.ToFloat64(gauges.JobsQueued))
	require.Equal(t, 1.0, testutil.ToFloat64(gauges.JobsInFlight))
	require.Equal(t, 100.0, testutil.ToFloat64(gauges.BytesInFlight))
	system.Root.Send(pid, &transfer.Cancel{Owner: owner, IDs: []sched.JobID{2}})
	got := testkit.Recv(t, done, 5*time.Second, "cancelled job 2")
	require.Equal(t, sched.JobID(2), got.ID)
	require.True(t, got.Cancelled)
	close(dev.gate)
	for _, id := range []sched.JobID{1, 3} {
		got := testkit.Recv(t, done, 5*time.Second, fmt.Sprintf("job %d", id))
		require.Equal(t, id, got.ID)
		require.NoError(t, got.Err)
		require.False(t, got.Cancelled)
	}
	require.Zero(t, testutil.ToFloat64(gauges.JobsQueued))
	require.Zero(t, testutil.ToFloat64(gauges.JobsInFlight))
	copied, aborted := st.seen()
	require.Equal(t, []messages.Key{"j1-0", "j3-0"}, copied)
	require.Equal(t, []messages.Key{"j2-0"}, aborted)
}

// A copy's end starts every queued job the in-flight bound now allows, not
// only the one its own worker takes next: each worker that takes a job wakes
// another waiting one while the next job fits.
func TestACopysEndStartsEveryJobTheBoundAllows(t *testing.T) {
	system := actor.NewActorSystem()
	t.Cleanup(system.Shutdown)
	m := metrics.NewTransfer(nil)
	pid := system.Root.Spawn(transfer.Props(transfer.Deps{Config: transfer.Config{Workers: 3, MaxInFlightBytes: 300},
		Metrics: m, Tracer: noop.NewTracerProvider().Tracer(""), Log: slog.New(slog.NewTextHandler(io.Discard, nil))}))
	done := make(chan *transfer.JobDone, 8)
	owner := system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return &sink{ch: done} }))
	dev := &gatedDevice{gate: make(chan struct{})} // each send on gate ends one copy
	st := &gatedStore{dev: dev}

	system.Root.Send(pid, job(owner, 1, backend.DeviceToHost, st, 3)) // 300 bytes: runs alone
	waitStarted(t, dev, 1)
	for id := sched.JobID(2); id <= 4; id++ {
		system.Root.Send(pid, job(owner, id, backend.DeviceToHost, st, 1)) // 100 each: wait
	}
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if q := testutil.ToFloat64(m.JobsQueued); q != 3 {
			return fmt.Errorf("%v jobs queued, want 3", q)
		}
		return nil
	})
	dev.gate <- struct{}{} // job 1 ends: 2, 3 and 4 (300 bytes) may all run now
	waitStarted(t, dev, 4)
	require.Equal(t, []int64{300, 100, 100, 100}, dev.startedCopies())
	for range 3 {
		dev.gate <- struct{}{}
	}
	for range 4 {
		select {
		case d := <-done:
			require.NoError(t, d.Err)
		case <-time.After(5 * time.Second):
			t.Fatal("missing JobDone")
		}
	}
	var h dto.Metric
	require.NoError(t, m.QueueWait.Write(&h))
	require.Equal(t, uint64(4), h.GetHistogram().GetSampleCount(), "each copy's queue wait, once")
	require.Positive(t, h.GetHistogram().GetSampleSum(), "jobs 2 to 4 waited for job 1")
}
