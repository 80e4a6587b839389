package actors

import (
	"runtime"
	"slices"
	"sync/atomic"
	"testing"
	"testing/quick"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
)

// Whatever order messages are sent in, they come out by due time, and in
// the order sent when due at the same time.
func TestTimersFallDueInOrder(t *testing.T) {
	base := time.Now().Add(-time.Hour) // all due already
	check := func(offsets []uint8) bool {
		tm := &Timers{wake: make(chan struct{}, 1)} // no goroutine: next is driven here
		for i, o := range offsets {
			tm.sendAt(base.Add(time.Duration(o%8)*time.Millisecond), nil, i)
		}
		var got []int
		for {
			e, wait, ok := tm.next()
			if !ok || wait > 0 {
				break
			}
			got = append(got, e.msg.(int))
		}
		want := make([]int, len(offsets))
		for i := range want {
			want[i] = i
		}
		slices.SortStableFunc(want, func(a, b int) int { return int(offsets[a]%8) - int(offsets[b]%8) })
		return slices.Equal(got, want)
	}
	require.NoError(t, quick.Check(check, &quick.Config{MaxCount: 500}))
}

// The earliest pending message sets the wait; none pending waits long.
func TestTimersWaitForTheEarliest(t *testing.T) {
	tm := &Timers{wake: make(chan struct{}, 1)}
	_, wait, ok := tm.next()
	require.True(t, ok)
	require.Equal(t, time.Hour, wait)
	tm.Send(time.Minute, nil, "late")
	tm.Send(time.Second, nil, "early")
	_, wait, _ = tm.next()
	require.Greater(t, wait, time.Duration(0))
	require.LessOrEqual(t, wait, time.Second)
	require.Equal(t, 2, tm.Pending())
}

// stringSink is an actor system with an actor that passes on every string
// it receives.
func stringSink(t *testing.T) (*actor.ActorSystem, *actor.PID, chan string) {
	system := actor.NewActorSystem()
	t.Cleanup(system.Shutdown)
	got := make(chan string, 4)
	pid := system.Root.Spawn(actor.PropsFromFunc(func(c actor.Context) {
		if s, ok := c.Message().(string); ok {
			got <- s
		}
	}))
	return system, pid, got
}

// A message due before the one the goroutine sleeps for wakes it: a 10 ms
// retry never waits behind a 1 s one.
func TestTimersEarlierMessageWakesTheGoroutine(t *testing.T) {
	system, pid, got := stringSink(t)
	sleeping := make(chan struct{})
	var once atomic.Bool
	tm := &Timers{root: system.Root, wake: make(chan struct{}, 1), done: make(chan struct{}),
		waiting: func(d time.Duration) {
			if d > 30*time.Second && once.CompareAndSwap(false, true) {
				close(sleeping) // about to sleep for "late"
			}
		}}
	go tm.run()
	t.Cleanup(tm.Stop)
	tm.Send(time.Minute, pid, "late")
	select {
	case <-sleeping:
	case <-time.After(10 * time.Second):
		t.Fatal("the goroutine never waited for the late message")
	}
	tm.Send(time.Millisecond, pid, "early")
	select {
	case s := <-got:
		require.Equal(t, "early", s)
	case <-time.After(10 * time.Second):
		t.Fatal("the earlier message did not wake the goroutine")
	}
	require.Equal(t, 1, tm.Pending(), "late still waits")
}

// The point of Timers: deliveries that block (request actors run inline on
// the sender and may wait for a shared lock) hold one goroutine, not one
// each, and every message still arrives once the block clears.
func TestTimersDeliverFromOneGoroutine(t *testing.T) {
	system := actor.NewActorSystem()
	t.Cleanup(system.Shutdown)
	tm := NewTimers(system.Root, nil)
	t.Cleanup(tm.Stop)

	gate := make(chan struct{})
	entered := make(chan struct{}, 1)
	var delivered atomic.Int32
	props := actor.PropsFromFunc(func(c actor.Context) {
		if _, ok := c.Message().(string); !ok {
			return
		}
		select {
		case entered <- struct{}{}:
		default:
		}
		<-gate // like a release lock held elsewhere
		delivered.Add(1)
	}, actor.WithMailbox(InlineMailbox))

	const n = 500
	pids := make([]*actor.PID, n)
	for i := range pids {
		pids[i] = system.Root.Spawn(props)
	}
	before := runtime.NumGoroutine()
	for _, pid := range pids {
		tm.Send(0, pid, "retry")
	}
	select {
	case <-entered:
	case <-time.After(10 * time.Second):
		t.Fatal("no delivery within 10s")
	}
	// The first delivery blocks; the other n-1 are due but wait their turn.
	require.Equal(t, n-1, tm.Pending())
	require.LessOrEqual(t, runtime.NumGoroutine(), before+2, "no goroutine per blocked delivery")

	close(gate)
	deadline := time.Now().Add(10 * time.Second)
	for delivered.Load() < n {
		require.True(t, time.Now().Before(deadline), "delivered %d of %d", delivered.Load(), n)
		runtime.Gosched()
	}
	require.Zero(t, tm.Pending())
}

// Stop drops what is pending and ends the goroutine; later Sends and a
// second Stop are harmless.
func TestTimersStopDropsPending(t *testing.T) {
	system, pid, got := stringSink(t)
	gauge := prometheus.NewGauge(prometheus.GaugeOpts{Name: "pending"})
	tm := NewTimers(system.Root, gauge)
	tm.Send(time.Hour, pid, "never")
	tm.Send(time.Hour, pid, "never either")
	require.Equal(t, 2, tm.Pending())
	require.Equal(t, 2.0, testutil.ToFloat64(gauge))
	tm.Stop()
	require.Zero(t, tm.Pending())
	require.Zero(t, testutil.ToFloat64(gauge), "dropped messages leave the gauge")
	tm.Send(0, pid, "after stop")
	require.Zero(t, tm.Pending())
	tm.Stop()
	select {
	case <-tm.done:
	case <-time.After(10 * time.Second):
		t.Fatal("the delivering goroutine is still running")
	}
	require.Empty(t, got)
}
