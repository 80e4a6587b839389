package transfer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/tracing"
)

// Config bounds the node's copies (one transfer actor per node; a node serves one GPU).
type Config struct {
	// Workers is the number of copies running at once (default 2).
	Workers int
	// MaxInFlightBytes bounds the bytes of running copies; a job larger than
	// the bound still runs, alone (default 256 MiB).
	MaxInFlightBytes int64
	// EngineSilence: no copy of a job whose engine (Submit.Hearing) has
	// been silent this long starts, and one running stops between device
	// calls (ErrEngineSilent). The node sets lease/2; 0: no such check.
	EngineSilence time.Duration
}

// DefaultConfig is 2 workers and 256 MiB in flight.
func DefaultConfig() Config { return Config{Workers: 2, MaxInFlightBytes: 256 << 20} }

func (c Config) withDefaults() Config {
	d := DefaultConfig()
	if c.Workers <= 0 {
		c.Workers = d.Workers
	}
	if c.MaxInFlightBytes <= 0 {
		c.MaxInFlightBytes = d.MaxInFlightBytes
	}
	return c
}

// Deps is what the actor needs from its node.
type Deps struct {
	Config  Config
	Metrics *metrics.Transfer
	// Unexpected counts messages with no case (nil: not counted).
	Unexpected prometheus.Counter
	Tracer     trace.Tracer
	Log        *slog.Logger
	// Fence, when set, holds copies back while NATS is unreachable.
	Fence *Fence
	// Queue, when set, is the queue the actor runs (NewQueue), shared with
	// owners that push their jobs straight to it (Queue.Submit); nil: the
	// actor makes its own, reached only through Submit messages.
	Queue *Queue
	// Now is the clock the engine-silence check reads (nil: time.Now).
	Now func() time.Time
}

// Actor is the node's transfer actor. It owns the queue and its
// workers; the workers take jobs from the queue and report each end as a
// message, so JobDone, metrics and spans are handled here, in Receive.
type Actor struct {
	deps    Deps
	loop    *actors.LoopDispatcher // runs this actor's mailbox; closed when it stops
	q       *Queue
	workers sync.WaitGroup
	more    []bool                  // finish's scratch (lastPerOwner)
	seen    map[*actor.PID]struct{} // lastPerOwner's (nil: made on first need)
	// panicLogged is when copyPanicked last logged (UnixNano).
	panicLogged atomic.Int64
	// byDir are each direction's series, looked up once: a label lookup
	// hashes its values, four of them per copy.
	byDir [2]dirSeries
}

type dirSeries struct {
	bytes, secs, failures prometheus.Counter
	size                  prometheus.Observer
}

// Props builds one transfer actor (spawn it once, from the root context:
// its mailbox runs on a goroutine of its own). Its workers stop when it
// stops. It is never restarted: a fresh instance would start a second set
// of workers on the same queue. A failed turn is logged and the actor
// resumed (resumeOnFailure).
func Props(deps Deps) *actor.Props {
	deps.Config = deps.Config.withDefaults()
	loop := actors.NewLoopDispatcher()
	return actor.PropsFromProducer(func() actor.Actor { return &Actor{deps: deps, loop: loop} },
		actor.WithDispatcher(loop), actor.WithGuardian(resumeOnFailure))
}

// resumeOnFailure is the transfer actor's guardian strategy: protoactor's
// default would restart it (see Props).
var resumeOnFailure = actors.ResumeOnPanic("transfer actor failed; resumed", nil)

func (a *Actor) Receive(c actor.Context) {
	switch m := c.Message().(type) {
	case *actor.Started:
		a.start(c)
	case *actor.Stopping:
		// Workers finish the copy they hold and exit; the actor stops only
		// after they have, so whoever frees the devices and the arena after
		// stopping it (node teardown) never frees memory under a copy.
		a.q.close()
		a.workers.Wait()
		a.q.workersGone()
		a.answerLoads(c)
		a.q.exit() // a Drain still waiting is answered now, and a later one at once
	case *actor.Stopped:
		a.loop.Close()
	case *actor.Restarting:
	case *Submit:
		a.q.Submit(m)
	case *Cancel:
		a.cancelled(c, a.q.cancel(m.Owner, m.IDs))
	case *Drain:
		then := m.Then
		if then == nil {
			root, to, owner := c.ActorSystem().Root, m.ReplyTo, m.Owner
			then = func() { root.Send(to, &Drained{Owner: owner}) }
		}
		// Its JobDones are sent as for Cancel, though its owner is gone.
		a.q.drain(m.Owner, then, func(jobs []*Submit) { a.cancelled(c, jobs) })
	case *completed:
		done := a.q.take()
		a.finish(c, done)
		a.q.giveBack(done)
	default:
		if a.deps.Unexpected != nil {
			a.deps.Unexpected.Inc()
		}
	}
}

// answerLoads answers, as the actor stops (its workers have exited), every
// load it took and has not answered: one whose copy ended meanwhile gets
// its JobDone (the completed message telling of it would come after the
// stop, and be dropped), one still queued never runs and is cancelled as
// by Cancel (pool side aborted, JobDone with Cancelled). A load's owner
// answers its engine and counts the load out on it: without, the reply
// never went and the engine's loads in flight never drained. Stores are
// left unanswered: their owners retire before the node stops this actor,
// and one told now would decide again, making room in a pool about to go.
func (a *Actor) answerLoads(c actor.Context) {
	var ended []*copyDone
	for _, d := range a.q.take() {
		if d.job.Dir == backend.HostToDevice {
			ended = append(ended, d)
		}
	}
	a.finish(c, ended)
	a.cancelled(c, a.q.takeLoads())
}

// cancelled aborts the pool side of jobs taken off the queue before they
// ran and tells their owners. An Abort that panics is reported (Queue.abort)
// and the rest go on: every owner still gets its JobDone.
func (a *Actor) cancelled(c actor.Context, jobs []*Submit) {
	for i, s := range jobs {
		a.q.abort(s)
		c.Send(s.Owner, &JobDone{ID: s.ID, Cancelled: true, More: i < len(jobs)-1})
	}
}

func (a *Actor) start(c actor.Context) {
	if a.q = a.deps.Queue; a.q == nil {
		a.q = NewQueue(a.deps.Config, a.deps.Metrics)
	}
	a.q.setReport(a.deps.Log, a.deps.Metrics.ThenFailures, a.deps.Metrics.AbortFailures)
	a.q.answerVia(c.ActorSystem().Root)
	for _, d := range backend.Directions {
		dir, m := d.String(), a.deps.Metrics
		a.byDir[d] = dirSeries{bytes: m.TransferBytes.WithLabelValues(dir), secs: m.TransferTime.WithLabelValues(dir),
			failures: m.CopyFailures.WithLabelValues(dir), size: m.CopySize.WithLabelValues(dir)}
	}
	self, root := c.Self(), c.ActorSystem().Root
	for range a.deps.Config.Workers {
		a.workers.Add(1)
		go a.worker(root, self)
	}
}

// finish reports a batch of finished copies, in the order they finished:
// each owner's JobDone but its last carries More (the owners run inline in
// this turn unless their mailbox was busy). The pool's journal, not this,
// announces the chunks (kv_events). The batch is off the queue already
// (take): if counting a copy panics (a collector's bug), that copy's and
// every later copy's JobDone still go out before the panic goes on to the
// guardian (resumeOnFailure), or their owners would never learn their jobs
// ended.
func (a *Actor) finish(c actor.Context, done []*copyDone) {
	if a.seen == nil {
		a.seen = map[*actor.PID]struct{}{}
	}
	a.more = lastPerOwner(a.more[:0], done, a.seen)
	if len(done) > spareMost {
		a.seen = nil // a rare huge batch's set is not kept
	}
	more := a.more
	sent := 0 // the JobDones gone out (or going: a Send that panics is not retried)
	defer func() {
		if sent == len(done) {
			return
		}
		r := recover()
		for i, d := range done[sent:] {
			d.done = JobDone{ID: d.job.ID, Err: d.err, Bytes: d.job.Bytes, Duration: d.dur, More: more[sent+i]}
			c.Send(d.job.Owner, &d.done)
		}
		if r != nil {
			panic(r)
		}
	}()
	for i, d := range done {
		m := &a.byDir[d.job.Dir]
		switch {
		case errors.Is(d.err, ErrSessionLapsed):
			a.deps.Metrics.CopiesLapsed.Inc() // refused, not failed
		case errors.Is(d.err, ErrEngineSilent):
			a.deps.Metrics.CopiesSilent.Inc() // refused or stopped, not failed
		case errors.Is(d.err, ErrFencedMidCopy):
			a.deps.Metrics.CopiesFenced.Inc() // stopped, not failed
		case d.err != nil:
			m.failures.Inc()
		default:
			m.bytes.Add(float64(d.job.Bytes))
			m.secs.Add(d.dur.Seconds())
			m.size.Observe(float64(d.job.Bytes))
		}
		d.done = JobDone{ID: d.job.ID, Err: d.err, Bytes: d.job.Bytes, Duration: d.dur, More: more[i]}
		sent++
		c.Send(d.job.Owner, &d.done)
	}
}

// lastPerOwner marks each completion that its owner has another one after.
// Owners are compared by pointer (an actor's Self): two pointers to one
// owner only cost that owner an extra decision. seen is scratch for a batch
// past 8, left empty.
func lastPerOwner(more []bool, done []*copyDone, seen map[*actor.PID]struct{}) []bool {
	more = append(more[:0], make([]bool, len(done))...)
	if len(done) <= 8 {
		for i, d := range done {
			for _, e := range done[i+1:] {
				if e.job.Owner == d.job.Owner {
					more[i] = true
					break
				}
			}
		}
		return more
	}
	for i := len(done) - 1; i >= 0; i-- {
		o := done[i].job.Owner
		_, more[i] = seen[o]
		seen[o] = struct{}{}
	}
	clear(seen)
	return more
}

// worker runs copies until the queue closes.
func (a *Actor) worker(root *actor.RootContext, self *actor.PID) {
	defer a.workers.Done()
	lc := a.newLiveCheck()
	for job := a.q.next(); job != nil; job = a.q.next() {
		dur, err := a.run(job, lc)
		lc.job = nil // the check holds no job past its copy
		d := &job.finished
		*d = copyDone{job: job, err: err, dur: dur}
		first, due := a.q.done(d)
		if first {
			root.Send(self, &completed{})
		}
		if due != nil {
			a.q.runThens(due) // DrainThen: the owner's last copy has ended
		}
	}
}

// copy runs one job's copies through its store, inside the fence (if any).
// A copy the fence refuses (node stopping, session lapsed), or one whose
// engine has been silent (Hearing), never starts; its pool side is aborted.
// One whose engine falls silent while it runs is stopped by its store
// between device calls (Store.Copy's live check) with the same
// ErrEngineSilent. A copy that panics (a backend's bug) would end
// the process from a worker: it is recovered, logged with its stack and
// counted, its pool side aborted, and it fails with ErrCopyPanicked, so its
// owner retries it after a backoff as any failed copy.
func (a *Actor) copy(job *Submit, lc *liveCheck) (err error) {
	if f := a.deps.Fence; f != nil {
		if err := f.Enter(job.Session); err != nil {
			a.q.abort(job) // recovered: on a worker, a panic would end the process
			return err
		}
		defer f.Leave()
	}
	// After the fence, which may have held the copy: the latest moment
	// before it starts.
	if err := a.heardRecently(job); err != nil {
		a.q.abort(job)
		return err
	}
	defer func() {
		if r := recover(); r != nil {
			err = a.copyPanicked(job, r)
		}
	}()
	return job.Store.Copy(job.Dir, job.Chunks, lc.of(job))
}

// copyPanicked reports a recovered panic r of job's Store.Copy and aborts
// its pool side. Stores complete the pool as their last step, so a panic
// comes before it: the abort removes the chunks still pending (a store) or
// unpins the chunks read (a load). A load's steps after its end (dropping
// a chunk that failed its check) return a panic as an error instead
// (store.afterEnd): aborted again, keys by then another job's would be
// ended.
func (a *Actor) copyPanicked(job *Submit, r any) error {
	a.deps.Metrics.CopyPanics.Inc()
	// A backend that panics on every copy would log a stack per retry: one
	// a minute, the count says how many.
	now := time.Now().UnixNano()
	if last := a.panicLogged.Load(); now-last >= int64(time.Minute) && a.panicLogged.CompareAndSwap(last, now) {
		owner := ""
		if job.Owner != nil {
			owner = job.Owner.Id
		}
		a.deps.Log.Error("a copy's Store.Copy panicked; the job is aborted and fails (logged once a minute; see kvactors_transfer_copy_panics_total)",
			"engine", job.Engine, "owner", owner, "job", job.ID, "direction", job.Dir.String(), "reason", fmt.Sprint(r),
			"stack", string(debug.Stack()))
	}
	a.q.abort(job)
	return fmt.Errorf("%w: %v", ErrCopyPanicked, r)
}

// run is the one point where a copy starts: the store plans it, copies,
// checksums and completes the pool.
func (a *Actor) run(job *Submit, lc *liveCheck) (time.Duration, error) {
	taken := time.Now()
	if !job.Arrived.IsZero() {
		a.deps.Metrics.DecisionTime.Observe(taken.Sub(job.Arrived).Seconds())
	}
	a.deps.Metrics.QueueWait.Observe(taken.Sub(job.queued).Seconds())
	// With tracing off the job has no span: starting a no-op one would
	// still allocate its context, once per copy.
	span := trace.SpanFromContext(context.Background())
	if job.Span.IsValid() {
		_, span = a.deps.Tracer.Start(trace.ContextWithSpanContext(context.Background(), job.Span), tracing.SpanCopy)
	}
	if span.IsRecording() {
		span.SetAttributes(tracing.AttrEngine.String(job.Engine), tracing.AttrDirection.String(job.Dir.String()),
			tracing.AttrBytes.Int64(job.Bytes), tracing.AttrChunks.Int(len(job.Chunks)))
	}
	start := taken
	if job.Span.IsValid() { // past the span's start, the copy's own
		start = time.Now()
	}
	err := a.copy(job, lc)
	dur := time.Since(start)
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
	return dur, err
}
