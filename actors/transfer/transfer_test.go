package transfer_test

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/hostpool"
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
	<-d.gate
	return d.fail
}

func (d *gatedDevice) startedCopies() []int64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]int64(nil), d.started...)
}

type arena struct{ b []byte }

func (a arena) Bytes() []byte { return a.b }
func (a arena) Close() error  { return nil }

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
	pid := system.Root.Spawn(transfer.Props(transfer.Deps{Config: cfg, Arena: arena{make([]byte, 1<<20)},
		Metrics: metrics.Discard(), Tracer: noop.NewTracerProvider().Tracer(""),
		Log: slog.New(slog.NewTextHandler(io.Discard, nil))}))
	done := make(chan *transfer.JobDone, 64)
	owner := system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return &sink{ch: done} }))
	return system, pid, owner, done
}

var lay = &sched.Layout{BlocksPerChunk: 1, Groups: []sched.GroupLayout{{BlockBytes: 100,
	Regions: []messages.Region{{BlockStride: 100, BlockBytes: 100}}}}}

func job(owner *actor.PID, id sched.JobID, dir backend.Direction, dev backend.Device, blocks int) *transfer.Submit {
	s := &transfer.Submit{Owner: owner, ID: id, Dir: dir, Layout: lay, Device: dev, SlotBytes: 100}
	for i := 0; i < blocks; i++ {
		s.Chunks = append(s.Chunks, sched.JobChunk{Slot: 0, Blocks: []messages.BlockID{messages.BlockID(2 * (i + 1))}})
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
	system.Root.Send(pid, job(owner, 1, backend.DeviceToHost, dev, 1))
	waitStarted(t, dev, 1)
	system.Root.Send(pid, job(owner, 2, backend.DeviceToHost, dev, 2))
	system.Root.Send(pid, job(owner, 3, backend.DeviceToHost, dev, 3))
	system.Root.Send(pid, job(owner, 4, backend.HostToDevice, dev, 4))
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
	system.Root.Send(pid, job(owner, 1, backend.DeviceToHost, dev, 2)) // 200 bytes
	system.Root.Send(pid, job(owner, 2, backend.DeviceToHost, dev, 1)) // +100 > 250: waits
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

// The transfer side completes the pool itself: a finished store's keys are
// ready, a failed or cancelled one's are freed, a load's are unpinned, before
// the owner hears JobDone (so slots free at copy speed).
func TestTransferCompletesThePool(t *testing.T) {
	system, pid, owner, done := setup(t, transfer.Config{Workers: 1, MaxInFlightBytes: 1 << 20})
	pool := hostpool.NewShared(8)
	prep, err := pool.PrepareStore([]messages.Key{"a", "b", "c"})
	require.NoError(t, err)
	require.Len(t, prep.Keys, 3)
	dev := &gatedDevice{gate: make(chan struct{})}
	withKeys := func(s *transfer.Submit, keys ...messages.Key) *transfer.Submit {
		s.Pool, s.Keys = pool, keys
		return s
	}
	system.Root.Send(pid, withKeys(job(owner, 1, backend.DeviceToHost, dev, 1), "a"))
	waitStarted(t, dev, 1)
	system.Root.Send(pid, withKeys(job(owner, 2, backend.DeviceToHost, dev, 1), "b"))
	system.Root.Send(pid, &transfer.Cancel{Owner: owner, IDs: []sched.JobID{2}})
	d := testkit.Recv(t, done, 5*time.Second, "cancelled job")
	require.True(t, d.Cancelled)
	st, _ := pool.Lookup("b")
	require.Equal(t, hostpool.Absent, st, "a cancelled store frees its pending slot before JobDone")
	dev.gate <- struct{}{}
	d = testkit.Recv(t, done, 5*time.Second, "store job")
	require.NoError(t, d.Err)
	st, _ = pool.Lookup("a")
	require.Equal(t, hostpool.Ready, st, "a finished store is ready before JobDone")

	_, err = pool.PrepareLoad([]messages.Key{"a"})
	require.NoError(t, err)
	require.Equal(t, 1, pool.Stats().Pinned)
	close(dev.gate)
	system.Root.Send(pid, withKeys(job(owner, 3, backend.HostToDevice, dev, 1), "a"))
	testkit.Recv(t, done, 5*time.Second, "load job")
	require.Equal(t, 0, pool.Stats().Pinned, "a load unpins before JobDone")
}
