package transfer_test

import (
	"io"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/metrics"
)

// lapseFence is a fence on a fake clock whose waiters report on waiting (so
// a test knows Enter is blocked before it moves time) and whose lapses are
// counted.
type lapseFence struct {
	*transfer.Fence
	clock   *fakeClock
	waiting chan struct{}
	lapses  atomic.Int32
	ends    atomic.Int32
}

const lapseLease = 10 * time.Second

func newLapseFence(t *testing.T) *lapseFence {
	f := &lapseFence{clock: &fakeClock{now: time.Unix(1000, 0)}, waiting: make(chan struct{}, 16)}
	f.Fence = transfer.NewFence(lapseLease, f.clock.Now, func() { f.waiting <- struct{}{} })
	f.OnLapse(func() {
		// Outside the fence's lock: this would deadlock under it.
		_ = f.Fenced()
		f.lapses.Add(1)
	})
	f.OnLapseEnd(func() {
		_ = f.Fenced() // outside the lock too
		f.ends.Add(1)
	})
	t.Cleanup(f.Close)
	return f
}

// enterWaiting runs Enter(session) on its own goroutine and returns its result
// channel once it waits at the fence (the fence must be closed by then).
func (f *lapseFence) enterWaiting(t *testing.T, session uint64) <-chan error {
	t.Helper()
	entered := make(chan error, 1)
	go func() { entered <- f.Enter(session) }()
	testkit.Recv(t, f.waiting, 5*time.Second, "the copy to wait at the fence")
	return entered
}

// PROTOCOL.md "Fencing, node side", lapse: a copy waiting at the fence
// while no round trip came for 3/4 lease (an engine may have declared the
// node lost, heartbeats being lease/4 apart) never starts, even once a
// round trip comes; an outage shorter than that lets it start. (The
// reviewer's reproducer: queued at +6 s, round trip at +31 s.)
func TestFenceRefusesACopyWaitingAcrossALapse(t *testing.T) {
	for _, tc := range []struct {
		name  string
		gap   time.Duration // last round trip → the one that ends the wait
		lapse bool
	}{
		{"reviewer: 31s outage, lease 10s", 31 * time.Second, true},
		{"exactly 3/4 lease", lapseLease - lapseLease/4, true},
		{"just under 3/4 lease", lapseLease - lapseLease/4 - time.Millisecond, false},
		{"fenced, round trip at once", 6 * time.Second, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newLapseFence(t)
			f.clock.Add(6 * time.Second) // fenced: past lease/2
			entered := f.enterWaiting(t, f.Gen())
			f.clock.Add(tc.gap - 6*time.Second)
			f.RoundTrip(f.clock.Now())
			err := testkit.Recv(t, entered, 5*time.Second, "Enter's answer after the round trip")
			if !tc.lapse {
				require.NoError(t, err, "a short outage must let the copy start")
				f.Leave()
				require.Zero(t, f.lapses.Load())
				require.Zero(t, f.Gen())
				return
			}
			require.ErrorIs(t, err, transfer.ErrSessionLapsed)
			require.Equal(t, int32(1), f.lapses.Load(), "OnLapse once")
			require.Equal(t, uint64(2), f.Gen(), "recorded and ended by the one round trip")
			require.NoError(t, f.Enter(f.Gen()), "a copy of a session begun after the lapse starts")
			f.Leave()
		})
	}
}

// A job stamped before a lapse that reaches the fence only after it reopened
// is refused; a stamp taken during the lapse is stale too (its session may
// be an engine's abandoned one); one taken after the lapse ended starts.
func TestFenceStampsDecideAfterTheFenceReopened(t *testing.T) {
	f := newLapseFence(t)
	before := f.Gen()
	f.clock.Add(8 * time.Second)
	f.Check(f.clock.Now())
	during := f.Gen()
	require.NotEqual(t, before, during)
	f.RoundTrip(f.clock.Now())
	require.False(t, f.Fenced())
	after := f.Gen()
	require.NotEqual(t, during, after)

	require.ErrorIs(t, f.Enter(before), transfer.ErrSessionLapsed)
	require.ErrorIs(t, f.Enter(during), transfer.ErrSessionLapsed)
	require.NoError(t, f.Enter(after))
	f.Leave()
	require.Equal(t, int32(1), f.lapses.Load())
}

// The watchdog's Check records a lapse while NATS is still down: a waiting
// copy of the old session ends at once (its pool side can be aborted and
// its request reset during the outage), and OnLapse runs once however many
// checks, waiters and round trips see the same outage; a second outage is a
// second lapse.
func TestFenceCheckRecordsALapseOncePerOutage(t *testing.T) {
	f := newLapseFence(t)
	session := f.Gen()
	f.clock.Add(6 * time.Second) // fenced
	entered := f.enterWaiting(t, session)
	f.clock.Add(time.Second)
	f.Check(f.clock.Now()) // 7s: fenced, no lapse yet
	testkit.NoRecv(t, entered, 20*time.Millisecond, "Enter's answer before 3/4 lease")
	require.Zero(t, f.lapses.Load())

	f.clock.Add(time.Second)
	f.Check(f.clock.Now())
	require.ErrorIs(t, testkit.Recv(t, entered, 5*time.Second, "Enter's answer after the lapse"), transfer.ErrSessionLapsed)
	for range 3 {
		f.Check(f.clock.Add(time.Second))
	}
	// Enter itself notices nothing new, nor does a copy stamped during it.
	require.ErrorIs(t, f.Enter(session), transfer.ErrSessionLapsed)
	require.ErrorIs(t, f.Enter(f.Gen()+1), transfer.ErrSessionLapsed)
	require.Zero(t, f.ends.Load(), "no round trip yet: the lapse lasts")
	f.RoundTrip(f.clock.Now())
	require.Equal(t, int32(1), f.lapses.Load(), "one outage, one lapse")
	require.Equal(t, int32(1), f.ends.Load(), "the round trip ended it: the engines send their held orders")
	require.Zero(t, f.Gen()%2, "an even generation: no lapse lasts")

	// NATS answers again: no lapse; then a second outage.
	f.clock.Add(2 * time.Second)
	f.RoundTrip(f.clock.Now())
	f.Check(f.clock.Now())
	require.Equal(t, int32(1), f.lapses.Load())
	require.Equal(t, int32(1), f.ends.Load(), "a round trip outside a lapse ends none")
	f.clock.Add(9 * time.Second)
	f.Check(f.clock.Now())
	require.Equal(t, int32(2), f.lapses.Load(), "a second outage is a second lapse")
}

// Enter records a lapse itself when nothing else did (no watchdog tick, no
// round trip yet), running OnLapse outside the fence's lock.
func TestFenceEnterRecordsALapse(t *testing.T) {
	f := newLapseFence(t)
	session := f.Gen()
	f.clock.Add(lapseLease)
	// On a goroutine of its own: an Enter that missed the lapse would wait
	// for a round trip for ever, and the test must fail, not hang.
	enter := func(session uint64) error {
		t.Helper()
		got := make(chan error, 1)
		go func() { got <- f.Enter(session) }()
		return testkit.Recv(t, got, 5*time.Second, "Enter's answer")
	}
	require.ErrorIs(t, enter(session), transfer.ErrSessionLapsed)
	require.Equal(t, int32(1), f.lapses.Load())
	f.Close()
	require.ErrorIs(t, enter(f.Gen()), transfer.ErrFenceClosed, "closed beats lapsed")
}

// The transfer actor aborts a queued copy whose session lapsed (its pool
// side completes as for a cancel), reports ErrSessionLapsed to its owner,
// and counts it as lapsed, not failed.
func TestActorAbortsACopyOfALapsedSession(t *testing.T) {
	f := newLapseFence(t)
	system := actor.NewActorSystem()
	t.Cleanup(system.Shutdown)
	m := metrics.NewTransfer(nil)
	pid := system.Root.Spawn(transfer.Props(transfer.Deps{Config: transfer.Config{Workers: 1},
		Metrics: m, Tracer: noop.NewTracerProvider().Tracer(""),
		Log: slog.New(slog.NewTextHandler(io.Discard, nil)), Fence: f.Fence}))
	done := make(chan *transfer.JobDone, 8)
	owner := system.Root.Spawn(actor.PropsFromProducer(func() actor.Actor { return &sink{ch: done} }))
	dev := &gatedDevice{gate: make(chan struct{})}
	st := &gatedStore{dev: dev}

	old := f.Gen()
	system.Root.Send(pid, job(owner, 1, backend.DeviceToHost, st, 1)) // Session: old (0)
	waitStarted(t, dev, 1)
	system.Root.Send(pid, job(owner, 2, backend.HostToDevice, st, 1)) // queued behind job 1
	f.clock.Add(20 * time.Second)
	f.RoundTrip(f.clock.Now()) // a lapse, recorded and ended
	close(dev.gate)            // job 1 ends (the node would have fail-stopped on it)
	got := map[uint64]error{}
	for range 2 {
		d := testkit.Recv(t, done, 5*time.Second, "JobDone")
		got[uint64(d.ID)] = d.Err
	}
	require.NoError(t, got[1])
	require.ErrorIs(t, got[2], transfer.ErrSessionLapsed)
	copied, aborted := st.seen()
	require.Len(t, copied, 1, "the lapsed copy ran")
	require.Len(t, aborted, 1, "the lapsed copy's pool side not aborted")
	require.Len(t, dev.startedCopies(), 1)
	require.Equal(t, 1.0, testutil.ToFloat64(m.CopiesLapsed))
	require.Zero(t, testutil.ToFloat64(m.CopyFailures.WithLabelValues(backend.HostToDevice.String())))

	// A copy of the new session starts.
	next := job(owner, 3, backend.DeviceToHost, st, 1)
	next.Session = f.Gen()
	require.NotEqual(t, old, next.Session)
	system.Root.Send(pid, next)
	require.NoError(t, testkit.Recv(t, done, 5*time.Second, "JobDone of the new session").Err)
}

// The node marks which messages were read before the round trip that ends
// a lapse under the fence's lock, just before the generation moves on:
// also when one round trip both records the lapse and ends it (no watchdog
// look in between), and once per lapse.
func TestFenceMarksTheEndOfEveryLapse(t *testing.T) {
	f := newLapseFence(t)
	var marks []uint64
	f.OnLapseEnding(func(gen uint64) {
		marks = append(marks, gen)
		require.Equal(t, gen-1, f.Gen(), "called before the generation moves")
	})
	f.clock.Add(lapseLease) // silent past 3/4 lease, unnoticed so far
	f.RoundTrip(f.clock.Now())
	require.Equal(t, []uint64{2}, marks, "recorded and ended by one round trip: marked")
	require.Equal(t, uint64(2), f.Gen())

	f.clock.Add(time.Second)
	f.RoundTrip(f.clock.Now())
	require.Len(t, marks, 1, "no lapse: no mark")
	f.clock.Add(lapseLease)
	f.Check(f.clock.Now())
	f.RoundTrip(f.clock.Now())
	require.Equal(t, []uint64{2, 4}, marks)
}
