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

// waitDepth bounds the copies queued on one stream and not yet answered;
// past it, queueing the next waits for the oldest to end.
const waitDepth = 256

// spinWait is how long a waiter polls a copy's event before it blocks on
// it. Waking from a blocking wait took ~60 µs on an H200, more than a 2 MiB
// copy itself (~45 µs): a copy that ends within spinWait is seen at once,
// and a longer one pays the wake-up, a few percent of its time, and no CPU
// while it runs.
const spinWait = 100 * time.Microsecond

// worker owns one device's CUDA context. A CUDA context is current per OS
// thread, while the Go scheduler moves goroutines between threads at will:
// so one goroutine locks its thread (runtime.LockOSThread), makes the context
// current once, and makes every CUDA call of the device but the waiters'.
// Other goroutines hand it work over calls and wait for the reply. Each Copy
// is queued on a stream and ends with an event. One waiter per stream, on a
// locked thread of its own with the context current, answers the stream's
// copies in order (a stream runs them in order), each once its event has
// completed: it polls the event briefly (spinWait), then blocks on it (a
// blocking-sync event sleeps until the GPU's interrupt, at no CPU cost). The
// worker used to poll between calls with timer sleeps, which Go rounds up to
// about a millisecond when nothing else runs: a long copy was seen late, and
// the H200 moved 39 GB/s where plain cuMemcpyDtoH moved 44
// (docs/BENCHMARKS.md "GPU").
type worker struct {
	calls  chan *call
	quit   chan struct{}
	done   chan struct{} // closed once the goroutine has torn down and exited
	stop   sync.Once
	sticky atomic.Pointer[Error] // first error that broke the context
	// closeErr is written by the goroutine before done is closed.
	closeErr error

	// events are free events, reused; the waiters return them.
	events  eventPool
	waiters sync.WaitGroup

	// Owned by the goroutine alone.
	dev     cu.Device
	ctx     cu.CUContext
	streams []*stream
	next    int // stream for the next copy
	arenas  map[*arena]struct{}
	devices map[*device]struct{}
}

// stream is a CUDA stream and the queue its waiter answers copies from.
type stream struct {
	s       cu.Stream
	flights chan *flight
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

// eventPool holds events whose copies are answered, for the next copies.
type eventPool struct {
	mu   sync.Mutex
	free []cu.Event
}

func (p *eventPool) get() (cu.Event, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := len(p.free)
	if n == 0 {
		return cu.Event{}, false
	}
	ev := p.free[n-1]
	p.free = p.free[:n-1]
	return ev, true
}

func (p *eventPool) put(ev cu.Event) {
	p.mu.Lock()
	p.free = append(p.free, ev)
	p.mu.Unlock()
}

// drainAll empties the pool and returns what it held.
func (p *eventPool) drainAll() []cu.Event {
	p.mu.Lock()
	defer p.mu.Unlock()
	all := p.free
	p.free = nil
	return all
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
		st := &stream{s: s, flights: make(chan *flight, waitDepth)}
		w.streams = append(w.streams, st)
		ready := make(chan error, 1)
		w.waiters.Add(1)
		go w.wait(st, ready)
		if err := <-ready; err != nil {
			return err
		}
	}
	return nil
}

// wait is a stream's waiter: it answers the stream's copies in the order
// they were queued, each once its event has completed. It runs until the
// queue is closed (teardown) and empty. Like the worker's, its thread is
// never unlocked and ends with it.
func (w *worker) wait(st *stream, ready chan<- error) {
	defer w.waiters.Done()
	runtime.LockOSThread()
	if err := check("cuCtxSetCurrent", cu.SetCurrentContext(w.ctx)); err != nil {
		ready <- err
		return
	}
	ready <- nil
	for f := range st.flights {
		err := await(f.ev)
		w.events.put(f.ev)
		f.reply <- w.note(errors.Join(f.err, err))
	}
}

// await returns once ev has completed: polling it for spinWait, then
// blocking on it.
func await(ev cu.Event) error {
	deadline := time.Now().Add(spinWait)
	for time.Now().Before(deadline) {
		if err := ev.Query(); !errors.Is(err, cu.NotReady) {
			return check("cuEventQuery", err)
		}
	}
	return check("cuEventSynchronize", ev.Synchronize())
}

func (w *worker) loop() {
	for {
		select {
		case c := <-w.calls:
			w.handle(c)
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
	st := w.streams[w.next%len(w.streams)]
	s := st.s
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
			w.events.put(ev)
		}
	}
	if err != nil {
		err = errors.Join(failed, err, check("cuStreamSynchronize", s.Synchronize()))
		reply <- w.note(err)
		return
	}
	// Blocks only when waitDepth copies of this stream are unanswered: the
	// waiter needs nothing from this goroutine to answer the oldest.
	st.flights <- &flight{ev: ev, err: failed, reply: reply}
}

// event returns a free event or makes one. Blocking sync: the waiter sleeps
// until the copy ends instead of spinning a core. Timing is disabled: only
// completion is needed.
func (w *worker) event() (cu.Event, error) {
	if ev, ok := w.events.get(); ok {
		return ev, nil
	}
	ev, err := cu.MakeEvent(cu.BlockingSyncEvent | cu.DisableTiming)
	return ev, check("cuEventCreate", err)
}

// drain waits until every copy queued so far has ended; freeing or
// unmapping memory a copy still touches would corrupt it. Their waiters
// answer them. Only from the goroutine.
func (w *worker) drain() error {
	if w.sticky.Load() != nil {
		// The context is broken: nothing runs on its streams any more, and
		// Healthy reports the error; each close need not repeat it.
		return nil
	}
	var errs []error
	for _, st := range w.streams {
		errs = append(errs, w.note(check("cuStreamSynchronize", st.s.Synchronize())))
	}
	return errors.Join(errs...)
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

// teardown waits for copies in flight (their waiters answer them), then
// frees what is left: devices' mappings, arenas, events, streams, and the
// primary context reference.
func (w *worker) teardown() error {
	for _, st := range w.streams {
		close(st.flights)
	}
	w.waiters.Wait() // each answers its stream's copies first
	var errs []error
	for d := range w.devices {
		errs = append(errs, w.unmap(d))
	}
	for a := range w.arenas {
		errs = append(errs, w.free(a))
	}
	for _, ev := range w.events.drainAll() {
		errs = append(errs, check("cuEventDestroy", cu.DestroyEvent(&ev)))
	}
	for _, st := range w.streams {
		errs = append(errs, check("cuStreamDestroy", st.s.Destroy()))
	}
	w.streams = nil
	if w.ctx != (cu.CUContext{}) {
		errs = append(errs, check("cuDevicePrimaryCtxRelease", w.dev.ReleasePrimaryCtx()))
	}
	return errors.Join(errs...)
}
