package transfer

import (
	"fmt"
	"log/slog"
	"runtime/debug"
	"sync"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/sched"
)

// Queue is the node's copy queue, shared by the transfer actor (which adds
// and cancels jobs), its workers (which take the next job themselves) and,
// through Submit, the owners that push their jobs straight in.
// Workers pulling, rather than the actor handing out one job per worker,
// matters on a busy node: a worker that finishes a copy starts the next at
// once instead of waiting for the actor's mailbox to be scheduled (measured:
// copies ran at a fraction of their speed the other way). Every method is a
// short critical section; no copy happens under the lock.
type Queue struct {
	mu       sync.Mutex
	wake     sync.Cond
	items    []*Submit // loads first, then stores, each in arrival order
	running  int
	inflight int64 // bytes of running jobs
	maxBytes int64
	closed   bool
	// finished copies the actor has not taken yet (take); spare is the
	// list the actor gave back (giveBack), the next one's backing
	finished []*copyDone
	spare    []*copyDone
	idle     int // workers waiting in next
	// runs are the jobs copying (a worker took them, done not called yet):
	// as many as the workers, so a scan is cheap (Drain).
	runs []*Submit
	// thens wait for their owner's running copies to end (DrainThen); rare
	// and few. exited: the workers have exited (exit): a Then runs at once.
	thens  []ownerThen
	exited bool
	// workersGone fires once the workers have exited (Exited), stopped
	// once exit has run (Stopped).
	workersGoneL, stopped latch
	// thenFailures, abortFailures and log report a Then or a Store.Abort
	// that panicked (nil: not counted; log set by the transfer actor's
	// start).
	thenFailures  prometheus.Counter
	abortFailures prometheus.Counter
	log           *slog.Logger
	// root answers a job submitted after close (refuse); set by the
	// transfer actor's start, nil before.
	root *actor.RootContext
}

type ownerThen struct {
	owner *actor.PID
	then  func()
}

// NewQueue makes a copy queue bounded by cfg (see Deps.Queue) whose state
// gauges (nil: none) read at scrape time: the copy path sets no gauge (three
// per queue operation, on cache lines the submitting and copying cores
// passed back and forth, when it did).
func NewQueue(cfg Config, gauges *metrics.Transfer) *Queue {
	q := &Queue{maxBytes: cfg.withDefaults().MaxInFlightBytes}
	q.wake.L = &q.mu
	if gauges != nil {
		gauges.ReadQueueFrom(q.state)
		q.thenFailures = gauges.ThenFailures
		q.abortFailures = gauges.AbortFailures
	}
	return q
}

// state is what the gauges show.
func (q *Queue) state() metrics.QueueState {
	q.mu.Lock()
	defer q.mu.Unlock()
	return metrics.QueueState{Queued: len(q.items), Running: q.running, BytesInFlight: q.inflight}
}

// Submit adds a job; a load goes ahead of every store (a load is on a
// request's time to first token, a store only has to happen before the
// blocks are released) that fewer than loadsPastAStore loads went ahead of
// already: loads coming faster than the copies run would otherwise keep a
// store from ever starting, its request from being released, and its
// pending room from being freed. Owners may call it directly, without the hop
// through the transfer actor's mailbox that the Submit message takes: an
// engine step's copies are queued (and a worker woken) in the step's own
// turn. The owner gets its JobDone from the actor either way.
// The woken worker runs when the submitter's turn ends or the other core
// takes it; nothing yields for it (that held intake back: BENCHMARKS.md,
// eighth session).
//
// A job submitted once the queue has closed (the transfer actor stopping)
// never runs: its pool side is aborted, and a load's owner gets its JobDone
// with ErrQueueClosed at once (refuse). Without it, a load submitted as the
// node stopped was never answered, its engine waiting out its own timeout.
func (q *Queue) Submit(s *Submit) {
	s.queued = time.Now()
	q.mu.Lock()
	if q.closed {
		root := q.root
		q.mu.Unlock()
		q.refuse(s, root)
		return
	}
	i := len(q.items)
	if s.Dir == backend.HostToDevice {
		for i = 0; i < len(q.items); i++ {
			if it := q.items[i]; it.Dir != backend.HostToDevice && it.passed < loadsPastAStore {
				break
			}
		}
		for _, it := range q.items[i:] {
			if it.Dir != backend.HostToDevice {
				it.passed++
			}
		}
	}
	q.items = append(q.items, nil)
	copy(q.items[i+1:], q.items[i:])
	q.items[i] = s
	q.mu.Unlock()
	q.wake.Signal()
}

// refuse ends a job submitted after close: its pool side is aborted (a
// store's pending room freed, a load's keys unpinned) and a load's owner
// told, through the actor system's root context, which outlives the
// transfer actor: it answers its engine with the error and counts its load
// out. A store is left unanswered, as answerLoads leaves the stores still
// queued: its owner would only decide again (a failed copy is retried after
// a backoff, a cancelled one at once), making room in a pool about to go.
func (q *Queue) refuse(s *Submit, root *actor.RootContext) {
	q.abort(s)
	if s.Dir == backend.HostToDevice && root != nil && s.Owner != nil {
		root.Send(s.Owner, &JobDone{ID: s.ID, Err: ErrQueueClosed})
	}
}

// loadsPastAStore bounds the loads that go ahead of one queued store.
const loadsPastAStore = 16

// cancel removes the owner's queued jobs among ids and returns them.
func (q *Queue) cancel(owner *actor.PID, ids []sched.JobID) []*Submit {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.removeLocked(func(s *Submit) bool { return sameOwner(s.Owner, owner) && containsID(ids, s.ID) })
}

// takeLoads removes every queued load and returns them (the actor
// stopping: answerLoads).
func (q *Queue) takeLoads() []*Submit {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.removeLocked(func(s *Submit) bool { return s.Dir == backend.HostToDevice })
}

// takeOwnerLocked removes every queued job of owner and returns them.
func (q *Queue) takeOwnerLocked(owner *actor.PID) []*Submit {
	return q.removeLocked(func(s *Submit) bool { return sameOwner(s.Owner, owner) })
}

// removeLocked removes the queued jobs that match and returns them, in
// queue order (cancels and drains: rare, so a closure is fine). A removed
// head may have been what kept the job behind it waiting (too large to
// start beside the running copies): an idle worker is woken for it.
func (q *Queue) removeLocked(match func(*Submit) bool) []*Submit {
	out := extract(&q.items, match)
	if len(out) > 0 && q.idle > 0 && q.headFitsLocked() {
		q.wake.Signal()
	}
	return out
}

// extract removes the elements of *xs that match and returns them; both
// keep their order, and *xs keeps its array.
func extract[T any](xs *[]T, match func(T) bool) (out []T) {
	kept := (*xs)[:0]
	for _, x := range *xs {
		if match(x) {
			out = append(out, x)
			continue
		}
		kept = append(kept, x)
	}
	clear((*xs)[len(kept):])
	*xs = kept
	return out
}

// DrainThen is what a Drain does (the transfer actor calls it for the
// message), called directly by its sender rather than sent to the
// transfer actor, so it holds even once that actor has stopped (a message
// behind its stop would be dropped). It cancels owner's queued
// jobs (their pool side aborted here, each on its own: one Abort that
// panics is reported and the rest go on; the owner, which will take no
// JobDone again, gets none) and runs then once no job of owner is copying: at once,
// on the caller's goroutine, or on the worker that ends the owner's last
// copy, or, at the latest, when the transfer actor stops and its workers
// have exited. then must not block, and must touch only what is safe from
// another goroutine. The owner must not submit again.
func (q *Queue) DrainThen(owner *actor.PID, then func()) {
	q.drain(owner, then, func(jobs []*Submit) {
		for _, s := range jobs {
			q.abort(s)
		}
	})
}

// drain is DrainThen with what becomes of the cancelled jobs (cancel: it
// must abort their pool side), done before then may run: then is queued
// only after cancel returned, so a worker ending the owner's running copy
// meanwhile cannot run it first (a release before the aborts would leave
// the cancelled keys pending past it).
func (q *Queue) drain(owner *actor.PID, then func(), cancel func([]*Submit)) {
	cancel(q.takeOwner(owner))
	if q.thenDue(owner, then) {
		q.runThens([]ownerThen{{owner: owner, then: then}})
	}
}

// takeOwner removes and returns every queued job of owner. The lock is
// released by a defer: a panic here (comparing owners), recovered by the
// caller's guard, must not leave every worker and submitter blocked.
func (q *Queue) takeOwner(owner *actor.PID) []*Submit {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.takeOwnerLocked(owner)
}

// thenDue reports whether then is due now (no job of owner copying, or
// the workers exited); if not, it waits in thens, for the worker that ends
// the owner's last copy. The owner has no queued job left (takeOwner) and
// submits none, so none of its jobs starts between the two.
func (q *Queue) thenDue(owner *actor.PID, then func()) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.exited || !q.runningLocked(owner) {
		return true
	}
	q.thens = append(q.thens, ownerThen{owner: owner, then: then})
	return false
}

// dueThensLocked removes and returns the waiting Thens whose owner has no
// job copying any more.
func (q *Queue) dueThensLocked() []ownerThen {
	return extract(&q.thens, func(t ownerThen) bool { return q.exited || !q.runningLocked(t.owner) })
}

// runThens runs DrainThen's Thens. A
// panic in one is its sender's bug: it is logged and counted, and the
// others run all the same (on a worker, an unrecovered panic would end the
// process).
func (q *Queue) runThens(thens []ownerThen) {
	for _, t := range thens {
		q.runThen(t)
	}
}

func (q *Queue) runThen(t ownerThen) {
	defer func() {
		if r := recover(); r != nil {
			q.report(func(q *Queue) prometheus.Counter { return q.thenFailures },
				"a Drain's Then panicked; its release is lost", t.owner, r)
		}
	}()
	t.then()
}

// abort completes the pool side of a job that never ran (cancelled while
// queued, drained, or refused by the fence). A panic in it is the store's
// bug: it is logged and counted, and the caller goes on, so the owner's
// other jobs are still aborted, its JobDone still sent and its Drain still
// answered; that job's chunks are left as they were in the pool.
func (q *Queue) abort(s *Submit) {
	defer func() {
		if r := recover(); r != nil {
			q.report(func(q *Queue) prometheus.Counter { return q.abortFailures },
				"a copy's Store.Abort panicked; its pool side may be left part done", s.Owner, r)
		}
	}()
	s.Store.Abort(s.Dir, s.Chunks)
}

// report logs and counts a recovered panic r of owner's; counter picks the
// counter (read under the lock: setReport may set it meanwhile).
func (q *Queue) report(counter func(*Queue) prometheus.Counter, msg string, owner *actor.PID, r any) {
	q.mu.Lock()
	failures, log := counter(q), q.log
	q.mu.Unlock()
	if failures != nil {
		failures.Inc()
	}
	if log != nil {
		id := ""
		if owner != nil {
			id = owner.Id
		}
		log.Error(msg, "owner", id, "reason", fmt.Sprint(r), "stack", string(debug.Stack()))
	}
}

// setReport sets how runThen and abort report a panic: log, and each
// counter unless NewQueue had one already.
func (q *Queue) setReport(log *slog.Logger, thenFailures, abortFailures prometheus.Counter) {
	q.mu.Lock()
	q.log = log
	if q.thenFailures == nil {
		q.thenFailures = thenFailures
	}
	if q.abortFailures == nil {
		q.abortFailures = abortFailures
	}
	q.mu.Unlock()
}

// answerVia sets the context refuse answers through.
func (q *Queue) answerVia(root *actor.RootContext) {
	q.mu.Lock()
	q.root = root
	q.mu.Unlock()
}

// exit marks the workers exited (the transfer actor stopping) and runs the
// Thens still waiting: no copy runs any more.
func (q *Queue) exit() {
	q.runThens(q.markExited())
	q.mu.Lock()
	defer q.mu.Unlock()
	q.stopped.fire()
}

// Stopped is closed once the stopping transfer actor is done with the
// queue: its workers exited, the loads left answered, the waiting Thens
// run (a panic in answering them keeps it open: Exited is the one that
// says no copy runs).
func (q *Queue) Stopped() <-chan struct{} {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.stopped.wait()
}

// latch is a channel closed once, made on first use; its owner holds the
// lock that guards it.
type latch struct {
	ch    chan struct{}
	fired bool
}

func (l *latch) wait() chan struct{} {
	if l.ch == nil {
		l.ch = make(chan struct{})
	}
	return l.ch
}

func (l *latch) fire() {
	if !l.fired {
		l.fired = true
		close(l.wait())
	}
}

// markExited marks the workers exited and returns the Thens due (all of
// them); the lock is released by a defer, as in takeOwner.
func (q *Queue) markExited() []ownerThen {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.exited = true
	q.workersGoneL.fire()
	return q.dueThensLocked()
}

// workersGone closes Exited: the actor's Stopping calls it as soon as its
// workers have exited, before it answers the loads left (a panic there
// must not keep a shutdown waiting for copies that have ended).
func (q *Queue) workersGone() {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.workersGoneL.fire()
}

func (q *Queue) runningLocked(owner *actor.PID) bool {
	for _, s := range q.runs {
		if sameOwner(s.Owner, owner) {
			return true
		}
	}
	return false
}

// sameOwner compares owners as PID.Equal does, but a nil owner (a bug of
// its submitter) is nobody's and never panics: a panic while a removal
// compacts the queue in place would leave it with a job twice and another
// lost.
func sameOwner(a, b *actor.PID) bool {
	if a == nil || b == nil {
		return a == b
	}
	return a.Equal(b)
}

// next blocks until a job may start (the in-flight bound allows it; a job
// larger than the bound starts when nothing else runs) and returns it, or
// returns nil once the queue is closed.
func (q *Queue) next() *Submit {
	q.mu.Lock()
	defer q.mu.Unlock()
	for {
		if q.closed {
			return nil
		}
		if q.headFitsLocked() {
			s := q.items[0]
			q.items[0] = nil
			q.items = q.items[1:]
			q.running++
			q.inflight += s.Bytes
			q.runs = append(q.runs, s)
			if q.idle > 0 && q.headFitsLocked() {
				q.wake.Signal() // the next fits too: pass the wake-up on
			}
			return s
		}
		q.idle++
		q.wake.Wait()
		q.idle--
	}
}

// headFitsLocked reports whether the first queued job may start now.
func (q *Queue) headFitsLocked() bool {
	return len(q.items) > 0 && (q.inflight == 0 || q.inflight+q.items[0].Bytes <= q.maxBytes)
}

// done ends a running job, which may let a waiting large job start, and
// adds it to the finished list. It reports whether the list was empty: the
// caller then tells the actor (one message per batch of completions, not
// per job), and returns the Thens due now that the job ended (DrainThen:
// the caller runs them). It wakes no one: the worker that calls it goes on
// to next, takes the job its bytes made room for, and passes the wake-up on
// while the next fits too.
func (q *Queue) done(d *copyDone) (first bool, due []ownerThen) {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.running--
	q.inflight -= d.job.Bytes
	for i, s := range q.runs {
		if s == d.job {
			last := len(q.runs) - 1
			q.runs[i], q.runs[last] = q.runs[last], nil
			q.runs = q.runs[:last]
			break
		}
	}
	first = len(q.finished) == 0
	q.finished = append(q.finished, d)
	if len(q.thens) > 0 {
		due = q.dueThensLocked()
	}
	return first, due
}

// take returns the finished copies, oldest first, and empties the list.
func (q *Queue) take() []*copyDone {
	q.mu.Lock()
	defer q.mu.Unlock()
	out := q.finished
	q.finished, q.spare = q.spare, nil
	return out
}

// giveBack returns a list take handed out, handled: its backing takes the
// next completions, so a batch of them does not grow a new list. A list
// past spareMost is left to the collector.
func (q *Queue) giveBack(done []*copyDone) {
	if cap(done) == 0 || cap(done) > spareMost {
		return
	}
	clear(done) // no Submit kept alive through it
	q.mu.Lock()
	switch {
	case q.finished == nil: // nothing finished since take: the next batch's list
		q.finished = done[:0]
	case q.spare == nil:
		q.spare = done[:0]
	}
	q.mu.Unlock()
}

// spareMost bounds the completion lists and owner sets kept for reuse.
const spareMost = 4096

// Exited is closed once the queue's workers have exited: each finished the
// copy it held (the transfer actor's Stopping). Whoever frees the devices
// or the arena waits for it: a copy reads one and writes the other, and a
// fixed wait (protoactor's StopFuture gives up after 10 s) would free them
// under a copy still running.
func (q *Queue) Exited() <-chan struct{} {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.workersGoneL.wait()
}

// close wakes every worker to exit; queued jobs are left (the node is
// stopping; the actor answers the loads among them: answerLoads).
func (q *Queue) close() {
	q.mu.Lock()
	q.closed = true
	q.mu.Unlock()
	q.wake.Broadcast()
}

func containsID(ids []sched.JobID, id sched.JobID) bool {
	for _, x := range ids {
		if x == id {
			return true
		}
	}
	return false
}
