package engine

import (
	"context"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/asynkron/protoactor-go/actor"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/ratelog"
	"github.com/kvactors/kvactors/sched"
)

// Deps is what an engine actor needs from its node. Request is the template
// of its request actors' deps; its Transfer also drains the copies of a
// request actor that failed (transfer.Drain) before that request's release.
type Deps struct {
	Engine   string
	Request  request.Deps
	Outbox   *actors.Outbox
	Releases *actors.Releases
	Metrics  Metrics
	Log      *slog.Logger
	// Node and Boot name this node in resyncs and heartbeat replies; Lease
	// is the engine lease (expiry after it, resyncs repeat per Lease/4).
	Node, Boot string
	Lease      time.Duration
	// Now is the clock (time.Now when nil).
	Now func() time.Time
	// Expired is called (from Receive, once) when a Tick finds the engine
	// silent for a lease, with the actor's own pid (the engine may have
	// registered again since, under a new actor: that one lives on); the
	// node then retires it as on unregister. It reports whether the engine
	// ended (false: self is no longer the engine's actor, and its expiry is
	// not news worth a warning).
	Expired func(engine string, self *actor.PID) bool
	// Failed is called (from Receive, once) when the actor failed (a panic
	// in one of its turns: a bug, a poisoned message), before it begins to
	// end the engine as an unregister does: every request reset and released
	// engine_gone once its copies in flight are done, then the actor stops.
	// self is the failed actor; released, when not nil, receives that
	// retire's count (Retire.Reset) just before the actor stops (nil: it was
	// retiring already). The node then detaches the engine, so it is told
	// it is unknown and registers again (and resyncs).
	Failed func(engine string, self *actor.PID, released <-chan int)
	// Backlogged, when set, reports whether messages the node has taken off
	// NATS wait to be handled where the engine's would (its intake shard's
	// queue or worker, or the subscription's buffer): signs of life the
	// actor may not have seen. A Tick then leaves the engine alive until a
	// later one finds no backlog, for at most one more lease.
	Backlogged func() bool
	// Closed is closed once a retired engine has released every request and
	// stopped (after a last-resort stop, once the releases it left to the
	// copy queue went out: no copy of the engine runs); the node then
	// closes the engine's device.
	Closed chan struct{}
	// MaxRequests bounds live requests (PROTOCOL.md "Isolation"; 0: no
	// bound); an added past it is rejected (reason "limit").
	MaxRequests int
	// Reject logs rejections, rate-limited per reason (nil: not logged;
	// they are always counted).
	Reject *ratelog.Log
	// Session is the node's fence generation (transfer.Fence.Gen; nil:
	// always 0). When it moves, an engine may have declared the node lost:
	// the actor resyncs and resets its requests before anything else
	// (lapse), and stamps the next epoch's copies with the new value.
	Session func() uint64
	// Predecessors are the Closed channels of this engine's earlier actors
	// that had not closed when this one was made (a re-register, or a
	// register after a failure, while the old actor still ends): their
	// copies may still read GPU blocks the engine re-announces to this one.
	// Until every one has closed, this actor publishes no release of its
	// own (lineage.go, "predecessors").
	Predecessors []<-chan struct{}
	// Epochs, when set, is the engine's EpochTrail across its actors: this
	// one's Sequencer takes in what it holds, and it records each epoch it
	// begins there.
	Epochs *EpochTrail
}

// routed is one event to forward: its index in the batch and its request's
// index in the batch's first-seen order.
type routed struct{ event, request int }

type entry struct {
	id    string
	epoch string
	pid   *actor.PID
	// releasing: the request is publishing its final release (raised by its
	// actor, with the release's reason, request.Spawner.SpawnWatched); its
	// events no longer go to it.
	releasing request.Releasing
	// The entry's place in the routing scratch of batch number step (its
	// request's position in order): one map lookup per routed event, not two.
	step uint64
	idx  int
	// retired: reset by the retire (resetAll), so its release of the
	// retire's reason counts in Retire.Reset.
	retired bool
	// failed: its actor failed unreleased; its aborted release waits for
	// the transfer side's Drained (terminated), or, once the engine actor
	// stops, runs from the transfer side (handOff). Its events are rejected.
	failed bool
	// held: its releases wait for older requests of its id (lineage.go).
	// drained: failed, none of its copies is left (its release waits only
	// for the hold).
	held, drained bool
}

// Actor is one engine's actor: a shell around its sched.Sequencer (the
// session rules) that routes applied events to request actors. Its fields
// are touched only from Receive.
type Actor struct {
	deps     Deps
	loop     *actors.LoopDispatcher // runs what is not run inline; closed when it stops
	seq      *sched.Sequencer
	begun    string            // the epoch last seen begun (decided)
	live     map[string]*entry // request id → live request actor
	byPID    map[string]*entry // actor id → entry, live or draining
	perEpoch map[string]int    // epoch → entries in byPID
	// old: request id → its requests no longer live that may still copy,
	// oldest first; deferred: releases of unknown requests waiting for
	// them (lineage.go). Both nil until needed.
	old      map[string][]*entry
	deferred map[string][]deferredRelease
	// awaitingPredecessors: some of Deps.Predecessors have not closed; every
	// request is held and every release of its own deferred until then, and
	// forgetLater keeps the epochs whose release count may be forgotten
	// after (lineage.go, "predecessors").
	awaitingPredecessors bool
	forgetLater          []string
	// refused: ids whose added was refused for --max-requests, the engine
	// not told (a batch has no reply); a preempted of one is answered
	// like a finished (route). Bounded by maxRefused.
	refused refusedIDs
	// raised counts the final releases its requests raised (their
	// Releasing flags); swept is its value at the last dropReleased.
	raised   atomic.Uint64
	swept    uint64
	reqDeps  *request.Deps // the deps of the current epoch's requests (spawn)
	spawner  *request.Spawner
	retiring bool
	// what the retire releases: its reason, the releases of that reason
	// its resets brought (request.Done.Reason), and who waits for the count
	// (sent when the actor stops).
	retireReason string
	retireCount  int
	retireReply  chan<- int   // the retire that reset (Retire.Reset)
	retireLater  []chan<- int // later retires of the same reason, told the same count
	expired      bool
	counted      bool // this instance is in the live-engines gauge
	// turning is up while a turn runs: still up when the next begins, the
	// last one panicked (supervision resumed the actor to end it: fail).
	turning bool
	failed  bool // a turn panicked; the engine is ending (fail)
	// reported: Deps.Failed was called (report).
	reported bool
	// failing is up while fail runs: a panic then stops the actor (giveUp).
	failing bool
	// failures counts the turns that panicked (failure); gaveUp: the actor
	// stops itself (giveUp).
	failures int
	gaveUp   bool
	// stopFailed: a step of the stop panicked (guard); counted once.
	stopFailed bool
	// ends counts what Closed waits for: the actor until it has stopped,
	// and each release a stop handed to the copy queue (handOff).
	ends *ends
	// stopping: the actor is stopping (Stopping came); a Drained sent for
	// a failed request would find it gone (terminated).
	stopping bool
	// expiryChecking: a Tick found the lease run out and sent expiryCheck,
	// which confirms it behind whatever the mailbox held then.
	expiryChecking bool
	// session is the fence generation this actor last reset for (lapse).
	session uint64
	// epochSession stamps the current epoch's copies (request.Deps.Session):
	// the generation when its first batch was taken (Batch.Session).
	epochSession uint64
	// epochHearing is the engine's hearing generation when the current
	// epoch's first message was taken (Batch.HearingGen): its requests'
	// copies carry it, and it resumes loads only if no silence ended since.
	epochHearing uint64
	// resyncOwed: a lapse's resync order held back until the lapse ends
	// (lapse).
	resyncOwed bool
	// Scratch of one batch's routing (batch number step): the requests in
	// first-seen order (an entry whose step is current holds its position),
	// each one's event count, and the indexes of the events to forward.
	step   uint64
	order  []*entry
	counts []int
	fwd    []routed
}

// Props builds one engine actor (spawn it once, from the root context: what
// its mailbox does not run inline runs on a goroutine of its own, such as
// each released request's Done). Its request actors are stopped, never
// restarted, when they fail. It is never restarted either (a fresh instance
// would have lost its requests, its epoch and its seq): when it fails, its
// guardian (endOnFailure) resumes it, and it ends the engine as an
// unregister does (fail); later failures are resumed too, and it stops only
// as a last resort (giveUp).
func Props(deps Deps) *actor.Props {
	if deps.Now == nil {
		deps.Now = time.Now
	}
	loop := actors.NewLoopDispatcher()
	if deps.Session == nil {
		deps.Session = func() uint64 { return 0 }
	}
	return actor.PropsFromProducer(func() actor.Actor {
		gen := deps.Session()
		seq := sched.NewSequencer(deps.Now(), deps.Lease)
		if deps.Epochs != nil {
			seq.Inherit(deps.Epochs.Recent())
		}
		return &Actor{deps: deps, loop: loop, ends: newEnds(deps.Closed), live: map[string]*entry{}, byPID: map[string]*entry{},
			perEpoch: map[string]int{}, spawner: request.NewSpawner(), seq: seq,
			session: gen, epochSession: gen, resyncOwed: gen%2 == 1} // begun during a lapse: no order until it ends
	}, actor.WithSupervisor(actors.StopOnPanic(deps.Log.With("engine", deps.Engine))), actor.WithGuardian(endOnFailure),
		actor.WithMailbox(batchesInline), actor.WithDispatcher(loop))
}

// batchesInline runs an idle engine actor's batches on the goroutine that
// posts them (the ingest worker that decoded them: one engine step is one
// unit of work from decode to copy queue, with no goroutine hand-off);
// anything else posted to an idle actor starts a run on the actor's own
// loop goroutine (actors.LoopDispatcher). A run drains what queued meanwhile, so a tick or a
// retire that arrives during a batch is handled on the decode worker too. A
// Batch must not be posted by code holding a lock the actor's turn may
// take, and what a turn locks (the pool, the namespace table) must not be
// held across slow work elsewhere: a decode worker waits for it.
var batchesInline = actors.InlineMailboxFor(func(m any) bool {
	_, ok := m.(*Batch)
	return ok
})

func (a *Actor) Receive(c actor.Context) {
	if a.turning {
		// The last turn panicked and supervision resumed the actor: handle
		// that before anything else touches state that turn left half
		// changed (the failed message that wakes it may come later). Still
		// turning: a panic in failure is seen on the next message.
		a.failure(c)
	}
	a.turning = true
	a.receive(c)
	a.turning = false
}

func (a *Actor) receive(c actor.Context) {
	lapsed := false
	switch c.Message().(type) {
	case *Batch, *Heartbeat, *Lost, *Lapsed, *Tick:
		// The engine's session messages: a move of the node's fence
		// generation is handled before any of them (lapse), unless the
		// engine is ending (its requests are being reset already).
		if !a.ending() {
			lapsed = a.lapse(c)
		}
	}
	switch m := c.Message().(type) {
	case *actor.Started:
		a.countLive(true)
		a.awaitPredecessors(c)
	case predecessorsEnded:
		a.predecessorsEnded(c)
	case *actor.Restarting: // never (endOnFailure); counted as an end, should it come
		a.countLive(false)
	case *actor.Stopping:
		a.stopping = true
		a.handOffDraining(c)
		// No one is left to publish them once their older requests end.
		a.guard(c, "deferred releases", func() { a.publishAllDeferred() })
	case *actor.Stopped:
		a.stopped(c)
	case *Batch:
		if handed := a.batch(c, m); !handed && m.Recycle != nil {
			m.Recycle(clearEvents(m.Batch.Events))
		}
		if m.Done != nil {
			m.Done.Signal()
		}
	case *Heartbeat:
		a.heartbeat(c, m)
	case *Lost:
		if !m.AliveAt.IsZero() {
			a.seq.Touch(m.AliveAt)
		}
		if !lapsed && !a.ending() { // a lapse resynced the epoch already
			a.decided(c, context.Background(), a.seq.Lost(a.deps.Now(), m.Reason))
		}
	case *Lapsed: // handled above
	case *Silenced:
		if !a.ending() {
			a.silenced(c, m)
		}
	case *Touch:
		at := m.At
		if at.IsZero() {
			at = a.deps.Now()
		}
		a.seq.Touch(at)
	case *Tick:
		if !a.ending() && !a.expired && !a.expiryChecking && a.expiredAt(a.deps.Now()) {
			// A batch the intake handed over while this Tick ran waits behind
			// it in the mailbox, and the intake no longer counts it as a
			// backlog: look again once every message ahead of this one is in.
			a.expiryChecking = true
			c.Send(c.Self(), expiryCheck{})
		}
	case expiryCheck:
		a.expiryChecking = false
		if !a.ending() && !a.expired && a.expiredAt(a.deps.Now()) {
			a.expired = true
			if a.deps.Expired == nil || a.deps.Expired(a.deps.Engine, c.Self()) {
				a.deps.Log.Warn("engine expired: no sign of life for a lease", "engine", a.deps.Engine,
					"lease", a.deps.Lease)
			} else {
				// Not the engine's actor any more: replaced by a new
				// registration, or detached already (an unregister, a failure
				// or the node stopping, whose retire has not reached it yet).
				a.deps.Log.Debug("the lease ran out on an engine actor that no longer serves its engine (replaced or detached)",
					"engine", a.deps.Engine)
			}
		}
	case *request.Done:
		a.done(c, m)
	case *actor.Terminated:
		if a.stopping {
			// A panic here would keep protoactor from finishing the stop
			// (its children's ends lead to it): Closed would never close.
			a.guard(c, "a request actor's end while stopping", func() { a.terminated(c, m) })
			break
		}
		a.terminated(c, m)
		a.maybeStop(c) // a retire's last request may fail rather than report Done
	case *transfer.Drained:
		a.drained(c, m)
		a.maybeStop(c)
	case *Retire:
		a.retire(c, m)
	case *StatusQuery:
		a.status(c, m)
	case *failed: // a wake-up: the turn's prologue handled the failure (failure)
	default:
		a.deps.Metrics.Unexpected.Inc()
	}
}

// batch applies the session rules (sched.Sequencer) and routes the events of
// an applied batch, in order, one message per request. handed: the batch's
// event slice went to request actors, which recycle it (forward).
func (a *Actor) batch(c actor.Context, m *Batch) (handed bool) {
	b := &m.Batch
	if a.ending() {
		// Queued before its engine was detached (unregister, expiry, a new
		// spec, a failure): the engine is gone here, as for a batch ingest
		// finds no actor for (PROTOCOL.md, rejections: unknown_engine).
		a.deps.Metrics.Rejected.WithLabelValues(messages.RejectUnknownEngine).Inc()
		a.deps.Reject.Reject(messages.RejectUnknownEngine, "events for an engine being retired",
			"engine", a.deps.Engine, "epoch", b.Epoch, "seq", b.Seq)
		return false
	}
	a.deps.Metrics.Batches.Inc()
	now := a.deps.Now()
	if a.seq.Begins(b.Epoch) {
		// The batch begins an epoch: its copies carry the generation the
		// batch was taken in. Taken before a lapse ended (it waited in the
		// node's socket or queues while the engine may have given the node
		// up and reused the epoch's blocks), the epoch is stillborn: nothing
		// of it is applied, and it is resynced (when the lapse is over).
		gen := a.deps.Session()
		a.epochSession = gen
		if m.Stamped {
			a.epochSession = m.Session
		}
		a.epochHearing = a.hearingOf(m.Stamped, m.HearingGen)
		if a.epochSession != gen {
			a.deps.Log.Warn("an epoch begun by a batch taken before a NATS lapse ended: resyncing it",
				"engine", a.deps.Engine, "epoch", b.Epoch)
			a.decided(c, m.Ctx, a.seq.BeginLost(now, b.Epoch, b.Seq, messages.ResyncReconnect))
			a.deps.Metrics.DroppedBatch(messages.ResyncReconnect).Inc()
			return false
		}
	}
	d := a.seq.Batch(now, b.Epoch, b.Seq)
	a.decided(c, m.Ctx, d)
	switch d.Verdict {
	case sched.Duplicate, sched.Stale: // a stale batch is a late one of an epoch the engine left
		a.deps.Metrics.BatchDuplicate.Inc()
		return false
	case sched.Dropped:
		a.deps.Metrics.DroppedBatch(a.seq.ResyncReason()).Inc()
		return false
	}
	a.step++
	for i := range b.Events {
		e := a.route(c, m, &b.Events[i])
		if e == nil {
			continue
		}
		if e.step != a.step {
			e.step, e.idx = a.step, len(a.order)
			a.order = append(a.order, e)
			a.counts = append(a.counts, 0)
		}
		a.counts[e.idx]++
		a.fwd = append(a.fwd, routed{event: i, request: e.idx})
	}
	return a.forward(c, m)
}

// forward groups the routed events by request (order kept within each
// request) and sends each request its part, which the request actor holds
// until it has applied it (Events.Applied). Engines usually send a request's events together: then
// the batch's own slice is compacted in place; otherwise they are copied
// into one new slice, one allocation per batch.
func (a *Actor) forward(c actor.Context, m *Batch) (handed bool) {
	all, inPlace := groupEvents(m.Batch.Events, a.fwd, a.counts)
	var held *heldEvents
	if handed = inPlace && len(all) > 0 && m.Recycle != nil; handed {
		// The request actors get parts of the batch's own slice: the last
		// to apply its part recycles it (this turn holds one share).
		held = getHeldEvents(m.Batch.Events, m.Recycle)
	}
	var msgs []request.Events // one allocation for the step's messages, recycled with the events
	if held != nil {
		held.msgs = getEventMsgs(len(a.order))
		msgs = held.msgs
	} else {
		msgs = make([]request.Events, len(a.order))
	}
	// Every routed entry is still live: only the engine's own turns (done,
	// terminated, resetAll) remove one, and this is one turn.
	begin := 0
	for idx, e := range a.order {
		end := a.counts[idx]
		msgs[idx] = request.Events{Events: all[begin:end:end], Arrived: m.Arrived}
		if held != nil {
			held.left.Add(1)
			msgs[idx].Applied = held
		}
		c.Send(e.pid, &msgs[idx])
		begin = end
	}
	if held != nil {
		held.release()
	}
	clear(a.order) // no entry pinned past its life
	a.order, a.counts, a.fwd = a.order[:0], a.counts[:0], a.fwd[:0]
	return handed
}

func (a *Actor) status(c actor.Context, m *StatusQuery) {
	st := Status{Engine: a.deps.Engine, Epoch: a.seq.Epoch(), Seq: a.seq.Applied(), Resyncing: a.seq.Resyncing(),
		IdleActors: a.spawner.Idle()}
	if l := a.deps.Request.Layout; l != nil {
		st.RequestStateBytes, st.RequestStateLimit = l.Budget.Held(), l.Budget.Limit()
	}
	pids := make([]*actor.PID, 0, len(a.live))
	for _, e := range a.live {
		if !e.failed { // stopped: it would not answer
			pids = append(pids, e.pid)
		}
	}
	c.Spawn(collectorProps(st, pids, m.Reply))
}
