package transfer_test

import (
	"io"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/metrics"
)

// fakeClock is a clock the test moves by hand.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) Add(d time.Duration) time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
	return c.now
}

// PROTOCOL.md "Fencing, node side": with no NATS round trip for lease/2 a
// copy (store or load) does not start — it waits, it is not dropped — and
// starts once a round trip completes; a copy running 5/8 lease after the
// last round trip is overdue (the node fail-stops on it).
func TestFenceHoldsCopiesWithoutARoundTrip(t *testing.T) {
	const lease = 10 * time.Second
	clock := &fakeClock{now: time.Unix(1000, 0)}
	var waits atomic.Int32
	fence := transfer.NewFence(lease, clock.Now, func() { waits.Add(1) })
	system := actor.NewActorSystem()
	t.Cleanup(system.Shutdown)
	t.Cleanup(fence.Close)
	pid := system.Root.Spawn(transfer.Props(transfer.Deps{Config: transfer.Config{Workers: 2},
		Metrics: metrics.NewTransfer(nil), Tracer: noop.NewTracerProvider().Tracer(""),
		Log: slog.New(slog.NewTextHandler(io.Discard, nil)), Fence: fence}))
	done := make(chan *transfer.JobDone, 8)
	owner := system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return &sink{ch: done} }))
	dev := &gatedDevice{gate: make(chan struct{})}
	st := &gatedStore{dev: dev}

	// Fresh: a copy starts at once.
	system.Root.Send(pid, job(owner, 1, backend.DeviceToHost, st, 1))
	waitStarted(t, dev, 1)
	require.False(t, fence.Overdue(clock.Now()))

	// NATS silent for lease/2: the next copies (a store and a load) wait.
	clock.Add(lease / 2)
	system.Root.Send(pid, job(owner, 2, backend.DeviceToHost, st, 1))
	system.Root.Send(pid, job(owner, 3, backend.HostToDevice, st, 1))
	testkit.NoRecv(t, done, 50*time.Millisecond, "a JobDone while copies are fenced")
	require.Len(t, dev.startedCopies(), 1, "a copy started without a fresh round trip")

	// Copy 1 still running at 5/8 lease after the last round trip: overdue
	// (asked about a later time without moving the clock there, which would
	// be a lapse: see TestFenceRefusesACopyWaitingAcrossALapse).
	require.False(t, fence.Overdue(clock.Now()))
	require.False(t, fence.Overdue(clock.Now().Add(lease/8-time.Nanosecond)))
	require.True(t, fence.Overdue(clock.Now().Add(lease/8)),
		"5/8 lease: the watchdog (every lease/8) ends it before 3/4, when an engine may declare the node lost")

	// A round trip completes before 3/4 lease: the waiting copies start;
	// nothing was lost.
	fence.RoundTrip(clock.Now())
	require.False(t, fence.Overdue(clock.Now()))
	waitStarted(t, dev, 2) // one worker is still held by copy 1
	close(dev.gate)
	for range 3 {
		d := testkit.Recv(t, done, 5*time.Second, "JobDone")
		require.NoError(t, d.Err)
	}
	require.False(t, fence.Overdue(clock.Add(2*lease)), "nothing running: nothing overdue")
	require.Len(t, dev.startedCopies(), 3)
	require.Positive(t, waits.Load())
}

// A round trip older than the one already recorded changes nothing; Close
// releases a waiting copy with an error instead of leaving it stuck.
func TestFenceRoundTripOrderAndClose(t *testing.T) {
	const lease = time.Second
	clock := &fakeClock{now: time.Unix(0, 0)}
	waiting := make(chan struct{}, 1)
	fence := transfer.NewFence(lease, clock.Now, func() { waiting <- struct{}{} })
	clock.Add(lease / 2)
	fence.RoundTrip(clock.Now().Add(-lease)) // older than the start: ignored
	entered := make(chan error, 1)
	go func() { entered <- fence.Enter(fence.Gen()) }()
	testkit.Recv(t, waiting, 5*time.Second, "Enter to wait without a fresh round trip")
	testkit.NoRecv(t, entered, 20*time.Millisecond, "Enter without a fresh round trip")
	fence.Close()
	require.ErrorIs(t, testkit.Recv(t, entered, 5*time.Second, "Enter after Close"), transfer.ErrFenceClosed)
}
