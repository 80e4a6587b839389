//go:build cuda

package cuda

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"gorgonia.org/cu"

	"github.com/kvactors/kvactors/backend"
)

// Polling of in-flight copies: first yield to the scheduler a few times (a
// 2 MB copy takes ~50µs), then sleep with a backoff, so a long copy costs
// little CPU and a short one is seen quickly.
const (
	spinPolls  = 32
	minBackoff = 20 * time.Microsecond
	maxBackoff = time.Millisecond
)

// worker owns one device's CUDA context. A CUDA context is current per OS
// thread, while the Go scheduler moves goroutines between threads at will:
// so one goroutine locks its thread (runtime.LockOSThread), makes the context
// current once, and makes every CUDA call of the device. Other goroutines hand
// it work over calls and wait for the reply. It also keeps copies in flight
// without blocking: each Copy is queued on a stream, ends with an event, and
// the loop polls the events between receiving calls.
type worker struct {
	calls  chan *call
	quit   chan struct{}
	done   chan struct{} // closed once the goroutine has torn down and exited
	stop   sync.Once
	sticky atomic.Pointer[Error] // first error that broke the context
	// closeErr is written by the goroutine before done is closed.
	closeErr error

	// Owned by the goroutine alone.
	dev     cu.Device
	ctx     cu.CUContext
	streams []cu.Stream
	next    int        // stream for the next copy
	events  []cu.Event // free events, reused
	flight  []*flight
	arenas  map[*arena]struct{}
	devices map[*device]struct{}
}

// call is one request to the goroutine: fn runs synchronously, or cp is
// queued. Exactly one reply is sent on reply (buffered, 1) for every call
// the goroutine receives, so callers wait on it without a deadline.
type call struct {
	fn    func() error
	cp    *copyWork
	reply chan error
}

// copyWork is one Copy call, already checked and merged.
type copyWork struct {
	dir    backend.Direction
	dev    *device
	arena  *arena
	ranges []backend.Range
}

// flight is a queued copy waiting for its event.
type flight struct {
	ev    cu.Event
	err   error // an enqueue that failed; reported once the queued part is done
	reply chan error
}

// startWorker starts the goroutine and waits for its context and streams.
func startWorker(cfg Config) (*worker, error) {
	w := &worker{
		calls:   make(chan *call),
		quit:    make(chan struct{}),
		done:    make(chan struct{}),
		arenas:  map[*arena]struct{}{},
		devices: map[*device]struct{}{},
	}
	ready := make(chan error, 1)
	go w.run(cfg, ready)
	if err := <-ready; err != nil {
		return nil, err
	}
	return w, nil
}

// run is the goroutine. It never unlocks its thread: on exit the runtime
// then ends the thread, and no context binding leaks to other goroutines.
func (w *worker) run(cfg Config, ready chan<- error) {
	runtime.LockOSThread()
	defer close(w.done)
	if err := w.init(cfg); err != nil {
		ready <- errors.Join(err, w.teardown())
		return
	}
	ready <- nil
	w.loop()
	w.closeErr = w.teardown()
}

// init retains the device's primary context (the one the CUDA runtime and
// frameworks also use) and makes it current on this thread.
func (w *worker) init(cfg Config) error {
	dev, err := cu.GetDevice(cfg.Device)
	if err != nil {
		return check("cuDeviceGet", err)
	}
	w.dev = dev
	ctx, err := dev.RetainPrimaryCtx()
	if err != nil {
		return check("cuDevicePrimaryCtxRetain", err)
	}
	w.ctx = ctx
	if err := cu.SetCurrentContext(ctx); err != nil {
		return check("cuCtxSetCurrent", err)
	}
	for range cfg.Streams {
		// NonBlocking: copies must not wait behind work that other code
		// queues on the legacy default stream of the shared primary context.
		s, err := cu.MakeStream(cu.NonBlocking)
		if err != nil {
			return check("cuStreamCreate", err)
		}
		w.streams = append(w.streams, s)
	}
	return nil
}

func (w *worker) loop() {
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	spins, backoff := 0, minBackoff
	for {
		if w.poll() {
			spins, backoff = 0, minBackoff
		}
		if len(w.flight) == 0 {
			select {
			case c := <-w.calls:
				w.handle(c)
			case <-w.quit:
				return
			}
			continue
		}
		select {
		case c := <-w.calls:
			w.handle(c)
			continue
		case <-w.quit:
			return
		default:
		}
		if spins < spinPolls {
			spins++
			runtime.Gosched()
			continue
		}
		timer.Reset(backoff)
		select {
		case c := <-w.calls:
			w.handle(c)
		case <-timer.C:
			backoff = min(2*backoff, maxBackoff)
		case <-w.quit:
			return
		}
	}
}

func (w *worker) handle(c *call) {
	if c.cp != nil {
		w.startCopy(c.cp, c.reply)
		return
	}
	// Not noted: a refused handle or allocation says nothing about the
	// context, and copies, which are noted, see a broken one soon enough.
	c.reply <- c.fn()
}

// startCopy queues every range on the next stream and records one event
// after them. Only from the goroutine.
func (w *worker) startCopy(cp *copyWork, reply chan error) {
	if err := w.health(); err != nil {
		reply <- err
		return
	}
	if _, ok := w.devices[cp.dev]; !ok {
		reply <- fmt.Errorf("device: %w", backend.ErrClosed)
		return
	}
	if _, ok := w.arenas[cp.arena]; !ok {
		reply <- fmt.Errorf("arena: %w", backend.ErrClosed)
		return
	}
	s := w.streams[w.next%len(w.streams)]
	w.next++
	var failed error
	for _, r := range cp.ranges {
		host := unsafe.Add(cp.arena.ptr, r.PoolOff)
		dptr := cp.dev.ptrs[r.Segment] + cu.DevicePtr(r.SegOffset)
		if cp.dir == backend.HostToDevice {
			failed = check("cuMemcpyHtoDAsync", cu.MemcpyHtoDAsync(dptr, host, r.Len, s))
		} else {
			failed = check("cuMemcpyDtoHAsync", cu.MemcpyDtoHAsync(host, dptr, r.Len, s))
		}
		if failed != nil {
			break
		}
	}
	// Even when an enqueue failed, the ranges queued before it may still be
	// moving bytes: wait for them before replying, so the caller may reuse
	// the memory as soon as Copy returns.
	ev, err := w.event()
	if err == nil {
		if err = check("cuEventRecord", ev.Record(s)); err != nil {
			w.events = append(w.events, ev)
		}
	}
	if err != nil {
		err = errors.Join(failed, err, check("cuStreamSynchronize", s.Synchronize()))
		reply <- w.note(err)
		return
	}
	w.flight = append(w.flight, &flight{ev: ev, err: failed, reply: reply})
}

// event returns a free event or makes one. Timing is disabled: it makes
// recording and querying cheaper, and only completion is needed.
func (w *worker) event() (cu.Event, error) {
	if n := len(w.events); n > 0 {
		ev := w.events[n-1]
		w.events = w.events[:n-1]
		return ev, nil
	}
	ev, err := cu.MakeEvent(cu.DisableTiming)
	return ev, check("cuEventCreate", err)
}

// poll answers every copy whose event has completed and reports whether any
// did. Only from the goroutine.
func (w *worker) poll() bool {
	kept := w.flight[:0]
	for _, f := range w.flight {
		err := f.ev.Query()
		if errors.Is(err, cu.NotReady) {
			kept = append(kept, f)
			continue
		}
		w.events = append(w.events, f.ev)
		f.reply <- w.note(errors.Join(f.err, check("cuEventQuery", err)))
	}
	progress := len(kept) < len(w.flight)
	clear(w.flight[len(kept):])
	w.flight = kept
	return progress
}

// drain waits for every copy in flight; freeing or unmapping memory a copy
// still touches would corrupt it. Only from the goroutine.
func (w *worker) drain() {
	for _, f := range w.flight {
		err := check("cuEventSynchronize", f.ev.Synchronize())
		w.events = append(w.events, f.ev)
		f.reply <- w.note(errors.Join(f.err, err))
	}
	clear(w.flight)
	w.flight = w.flight[:0]
}

// note records an error that broke the context and passes err through.
func (w *worker) note(err error) error {
	var e *Error
	if errors.As(err, &e) && e.Sticky() {
		w.sticky.CompareAndSwap(nil, e)
	}
	return err
}

// health returns the error that broke the context, or ErrClosed once the
// worker has stopped. Safe from any goroutine.
func (w *worker) health() error {
	if e := w.sticky.Load(); e != nil {
		return fmt.Errorf("context unusable: %w", e)
	}
	select {
	case <-w.done:
		return fmt.Errorf("backend: %w", backend.ErrClosed)
	default:
		return nil
	}
}

// do runs fn on the goroutine and returns its error.
func (w *worker) do(fn func() error) error {
	return w.submit(&call{fn: fn, reply: make(chan error, 1)})
}

func (w *worker) submit(c *call) error {
	select {
	case w.calls <- c:
	case <-w.done:
		return fmt.Errorf("backend: %w", backend.ErrClosed)
	}
	return <-c.reply // always answered: see call
}

// close stops the goroutine and returns what teardown reported.
func (w *worker) close() error {
	w.stop.Do(func() { close(w.quit) })
	<-w.done // the goroutine exits once copies in flight end: see teardown
	return w.closeErr
}

// teardown waits for copies in flight, then frees what is left: devices'
// mappings, arenas, events, streams, and the primary context reference.
func (w *worker) teardown() error {
	w.drain()
	var errs []error
	for d := range w.devices {
		errs = append(errs, w.unmap(d))
	}
	for a := range w.arenas {
		errs = append(errs, w.free(a))
	}
	for _, ev := range w.events {
		errs = append(errs, check("cuEventDestroy", cu.DestroyEvent(&ev)))
	}
	w.events = nil
	for i := range w.streams {
		errs = append(errs, check("cuStreamDestroy", w.streams[i].Destroy()))
	}
	w.streams = nil
	if w.ctx != (cu.CUContext{}) {
		errs = append(errs, check("cuDevicePrimaryCtxRelease", w.dev.ReleasePrimaryCtx()))
	}
	return errors.Join(errs...)
}
