//go:build cuda

package cuda

// The waiters' slow paths, on the fake driver made slow: with
// FAKECUDA_DELAY_US a stream's events end in order, each that long after the
// later of its record and the previous one's end, and cuEventSynchronize and
// cuStreamSynchronize sleep until then (testdata/fakecuda.c). So Copy cannot
// return sooner than the delay after it was called, nor n copies on one
// stream end sooner than n delays: the lower bounds below hold on any
// machine, however loaded, and a waiter or drain that does not wait misses
// them by far.

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"gorgonia.org/cu"

	"github.com/kvactors/kvactors/backend"
)

// patience bounds every wait of these tests: far more than they take.
const patience = 30 * time.Second

func skipWithoutFake(t *testing.T) {
	t.Helper()
	if os.Getenv("KVACTORS_FAKECUDA") == "" {
		t.Skip("needs the fake driver of scripts/cuda-check (KVACTORS_FAKECUDA=1)")
	}
}

// slowDelay sets FAKECUDA_DELAY_US for the rest of the test and returns it.
func slowDelay(t *testing.T, d time.Duration) time.Duration {
	t.Setenv("FAKECUDA_DELAY_US", strconv.FormatInt(d.Microseconds(), 10))
	return d
}

// fixture is a backend under test with its own streams, device memory it
// copies to and from, and an arena. The device memory belongs to a second
// backend, as an engine's would, so the first may be closed by the test.
type fixture struct {
	b     *Backend
	buf   *DeviceBuffer
	dev   *device
	arena *arena
}

func newFixture(t *testing.T, streams int, size int64) *fixture {
	t.Helper()
	eng := openBackend(t)
	buf, err := eng.AllocDevice(size)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, buf.Free()) })
	b, err := Open(Config{Device: testDevice(), Streams: streams})
	require.NoError(t, err)
	t.Cleanup(func() { returns(t, "Close", b.Close) }) // again: nil
	dev, err := b.attachPointers([]cu.DevicePtr{buf.ptr}, []int64{size})
	require.NoError(t, err)
	t.Cleanup(func() { returns(t, "device Close", dev.Close) })
	a, err := b.AllocArena(size)
	require.NoError(t, err)
	t.Cleanup(func() { returns(t, "arena Close", a.Close) })
	return &fixture{b: b, buf: buf, dev: dev, arena: a.(*arena)}
}

// returns fails the test unless fn returns nil within patience: a Close
// that hangs fails the test instead of the whole binary's timeout.
func returns(t *testing.T, what string, fn func() error) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- fn() }()
	require.NoError(t, within(t, done, what), what)
}

// within fails the test unless ch is closed or yields within patience.
func within[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(patience):
		require.FailNow(t, "timed out", "waited %v for %s", patience, what)
		panic("unreachable")
	}
}

// queue hands cp to the worker as Copy does (see submit), to be answered on
// reply (buffered, 1), and returns once the worker took it, without waiting
// for the answer: so a test sees whether an answer is there already, and a
// second one, which Copy would hide.
func queue(w *worker, cp *copyWork, reply chan error) error {
	select {
	case w.calls <- &call{cp: cp, reply: reply}:
		return nil
	case <-w.done:
		return fmt.Errorf("backend: %w", backend.ErrClosed)
	}
}

// answered fails the test unless reply holds exactly one answer, nil.
func answered(t *testing.T, reply chan error, what string) {
	t.Helper()
	select {
	case err := <-reply:
		require.NoError(t, err, what)
	default:
		require.FailNow(t, "not answered", what)
	}
	select {
	case err := <-reply:
		require.FailNow(t, "answered twice", "%s: again with %v", what, err)
	default:
	}
}

// d2h is a copy of block i of the device memory to block i of the arena.
func (f *fixture) d2h(i, block int) *copyWork {
	r := []backend.Range{{SegOffset: int64(i * block), PoolOff: int64(i * block), Len: int64(block)}}
	return &copyWork{dir: backend.DeviceToHost, dev: f.dev, arena: f.arena, ranges: r}
}

// TestSlowCopiesAreAnsweredOnceTheyEnd: a copy still running after the
// waiter's spinWait is answered once its event ends, by the blocking
// cuEventSynchronize; more copies on one stream than waitDepth fill its
// queue, queueing the next waits for room, and every one is answered, once.
func TestSlowCopiesAreAnsweredOnceTheyEnd(t *testing.T) {
	skipWithoutFake(t)
	const block, n = 1024, 600 // n > waitDepth
	f := newFixture(t, 1, n*block)
	src := random(5, n*block)
	require.NoError(t, f.buf.Write(0, src))

	t.Run("copies past spinWait", func(t *testing.T) {
		d := slowDelay(t, 50*spinWait)
		for i := range 3 {
			clear(f.arena.Bytes())
			start := time.Now()
			require.NoError(t, f.dev.Copy(backend.DeviceToHost, f.arena, []backend.Range{{Len: n * block}}))
			took := time.Since(start)
			require.GreaterOrEqual(t, took, d, "copy %d answered before its event ended", i)
			require.True(t, bytes.Equal(src, f.arena.Bytes()), "copy %d", i)
		}
	})

	t.Run("a copy past spinWait is waited for in cuEventSynchronize, one within it is not", func(t *testing.T) {
		t.Setenv("FAKECUDA_FAIL", "cuEventSynchronize=1") // not sticky: the fixture stays usable
		slowDelay(t, 0)
		require.NoError(t, f.dev.Copy(backend.DeviceToHost, f.arena, []backend.Range{{Len: block}}), "a quick copy is seen by the poll")
		// Last: the injected failure returns at once, so the stream's end
		// stays ahead of the clock for a while.
		slowDelay(t, 50*spinWait)
		err := f.dev.Copy(backend.DeviceToHost, f.arena, []backend.Range{{Len: block}})
		require.ErrorContains(t, err, "cuEventSynchronize: CUDA_ERROR_INVALID_VALUE (1)", "the slow copy blocked")
		t.Setenv("FAKECUDA_FAIL", "")
	})

	t.Run("more than waitDepth on one stream", func(t *testing.T) {
		d := slowDelay(t, 3*spinWait)
		clear(f.arena.Bytes())
		replies := make(chan chan error, n)
		submitted := make(chan time.Duration, 1)
		start := time.Now()
		go func() {
			for i := range n {
				r := make(chan error, 1)
				if err := queue(f.b.w, f.d2h(i, block), r); err != nil {
					r <- err
				}
				replies <- r
			}
			submitted <- time.Since(start)
		}()
		all := make([]chan error, n)
		for i := range all {
			all[i] = within(t, replies, "a copy to be queued")
			require.NoError(t, within(t, all[i], "a copy's answer"), "copy %d", i)
		}
		took := time.Since(start)
		queued := within(t, submitted, "the copies to be queued")
		require.True(t, bytes.Equal(src, f.arena.Bytes()))
		// One stream ends its copies one after another, each d after the
		// previous: the last cannot be answered before n·d. And copy m can
		// be queued only once the waiter has taken copy m-waitDepth from the
		// queue, after answering m-waitDepth-1: the worker takes the last
		// one no sooner than (n-waitDepth-2)·d.
		require.GreaterOrEqual(t, took, n*d, "copies answered before their events ended")
		require.GreaterOrEqual(t, queued, (n-waitDepth-2)*d, "queueing never waited for room")
		returns(t, "Close", f.b.Close)
		for i, r := range all { // the waiter has ended: a second answer would be there
			select {
			case err := <-r:
				require.FailNow(t, "answered twice", "copy %d: again with %v", i, err)
			default:
			}
		}
		t.Logf("%d copies of %v each on one stream: queued in %v, answered in %v", n, d, queued, took)
	})
}

// TestCloseRacingSlowCopies: Close while slow copies fill (or nearly fill)
// every stream's queue, the worker waits for room and many more copies wait
// to be taken: every Copy returns, once, nil or an error wrapping
// backend.ErrClosed, and when Close returns (nil) every copy the worker took
// is answered. Half the copies are Copy calls, half go through queue, whose
// answers the test leaves in their channels.
func TestCloseRacingSlowCopies(t *testing.T) {
	skipWithoutFake(t)
	const block, n, before = 1024, 2000, 50 // n ≫ 2·waitDepth
	f := newFixture(t, 2, n*block)
	slowDelay(t, 10*spinWait)

	var going, returned atomic.Int64
	all := make(chan struct{})     // closed when every goroutine is about to copy
	started := make(chan struct{}) // closed when `before` Copy calls returned
	errs := make(chan error, n)
	replies := make([]chan error, n) // queue's, odd i: not read
	taken := make([]bool, n)         // queue took replies[i]; read after wg
	for i := 1; i < n; i += 2 {
		replies[i] = make(chan error, 1)
	}
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			if going.Add(1) == n {
				close(all)
			}
			if replies[i] != nil {
				err := queue(f.b.w, f.d2h(i, block), replies[i])
				taken[i] = err == nil
				errs <- err
				return
			}
			r := []backend.Range{{SegOffset: int64(i * block), PoolOff: int64(i * block), Len: block}}
			errs <- f.dev.Copy(backend.DeviceToHost, f.arena, r)
			if returned.Add(1) == before {
				close(started)
			}
		})
	}
	within(t, all, "the copies to start")
	within(t, started, "the first copies")
	depth := []int{len(f.b.w.streams[0].flights), len(f.b.w.streams[1].flights)}
	var answeredAtClose []bool // replies[i] held an answer when Close returned
	returns(t, "Close", func() error {
		err := f.b.Close()
		for _, r := range replies {
			answeredAtClose = append(answeredAtClose, len(r) == 1)
		}
		return err
	})
	ended := make(chan struct{})
	go func() { wg.Wait(); close(ended) }()
	within(t, ended, "the copies")
	close(errs)
	var ok, refused int
	for err := range errs {
		if err == nil {
			ok++
			continue
		}
		require.ErrorIs(t, err, backend.ErrClosed)
		refused++
	}
	require.Equal(t, n, ok+refused)
	require.GreaterOrEqual(t, ok, before)
	for i, r := range replies {
		if taken[i] {
			require.True(t, answeredAtClose[i], "copy %d, queued before Close, not answered when Close returned", i)
			answered(t, r, fmt.Sprintf("copy %d", i))
		}
	}
	require.ErrorIs(t, f.b.Healthy(), backend.ErrClosed)
	t.Logf("Close with %v queued: %d copies answered, %d refused as closed", depth, ok, refused)
}

// TestClosingWaitsForSlowCopies: closing an arena or a device waits for the
// copies queued before it to end (drain's cuStreamSynchronize) before it
// frees or unmaps their memory. The copies are handed to the worker
// directly, so they are queued before the Close for certain; on one stream,
// the kth ends k·d after the first was queued at the earliest.
func TestClosingWaitsForSlowCopies(t *testing.T) {
	skipWithoutFake(t)
	const k = 20
	for _, which := range []string{"arena", "device"} {
		t.Run(which, func(t *testing.T) {
			f := newFixture(t, 1, 4096)
			d := slowDelay(t, 50*spinWait)
			replies := make([]chan error, k)
			start := time.Now()
			for i := range replies {
				replies[i] = make(chan error, 1)
				require.NoError(t, queue(f.b.w, f.d2h(0, 4096), replies[i])) // taken: before the next
			}
			closer := f.arena.Close
			if which == "device" {
				closer = f.dev.Close
			}
			returns(t, which+" Close", closer)
			took := time.Since(start)
			require.GreaterOrEqual(t, took, k*d, "%s closed before its copies ended", which)
			for i, r := range replies {
				require.NoError(t, within(t, r, "a copy's reply"), "copy %d", i)
			}
			t.Logf("%d copies of %v each, then %s Close: returned after %v", k, d, which, took)
		})
	}
}

// TestWaiterStartFailing: when a waiter cannot make the context current on
// its thread, Open fails naming cuCtxSetCurrent, after the waiters already
// started have ended and the context reference is released; the next Open
// works.
func TestWaiterStartFailing(t *testing.T) {
	skipWithoutFake(t)
	device, err := cu.GetDevice(testDevice())
	require.NoError(t, err)
	released := func() bool {
		_, active, err := device.PrimaryCtxState()
		require.NoError(t, err)
		return active == 0
	}
	require.True(t, released(), "a backend of an earlier test is still open")
	open := func(t *testing.T) (*Backend, error) {
		type opened struct {
			b   *Backend
			err error
		}
		ch := make(chan opened, 1)
		go func() {
			b, err := Open(Config{Device: testDevice(), Streams: 3})
			ch <- opened{b, err}
		}()
		o := within(t, ch, "Open")
		return o.b, o.err
	}
	// The worker's cuCtxSetCurrent is the 1st with a context, then the
	// waiters', stream by stream (FAKECUDA_FAIL_NTH counts those).
	for _, tc := range []struct {
		name string
		nth  string
	}{{"worker", "1"}, {"first waiter", "2"}, {"middle waiter", "3"}, {"last waiter", "4"}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("FAKECUDA_FAIL_NTH", "cuCtxSetCurrent:"+tc.nth+"=201")
			b, err := open(t)
			require.ErrorContains(t, err, "cuCtxSetCurrent: CUDA_ERROR_INVALID_CONTEXT (201)")
			require.Nil(t, b)
			require.True(t, released(), "the primary context is still retained")
		})
	}

	b, err := open(t)
	require.NoError(t, err)
	require.False(t, released())
	buf, err := b.AllocDevice(4096)
	require.NoError(t, err)
	dev, err := b.attachPointers([]cu.DevicePtr{buf.ptr}, []int64{4096})
	require.NoError(t, err)
	a, err := b.AllocArena(4096)
	require.NoError(t, err)
	for range 3 { // one per stream
		require.NoError(t, dev.Copy(backend.DeviceToHost, a, []backend.Range{{Len: 4096}}))
	}
	require.NoError(t, errors.Join(dev.Close(), a.Close(), buf.Free(), b.Close()))
	require.True(t, released())
}
