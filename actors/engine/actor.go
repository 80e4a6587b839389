package engine

import (
	"context"
	"log/slog"

	"github.com/asynkron/protoactor-go/actor"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/ratelog"
)

// Deps is what an engine actor needs from its node. Request is the template
// of its request actors' deps.
type Deps struct {
	Engine  string
	Request request.Deps
	Outbox  *actors.Outbox
	Metrics *metrics.Metrics
	Log     *slog.Logger
	// Closed is closed once a retired engine has released every request and
	// stopped; the node then closes the engine's device.
	Closed chan struct{}
	// MaxRequests bounds live requests (PROTOCOL.md "Isolation"; 0: no
	// bound); an added past it is rejected (reason "limit").
	MaxRequests int
	// Reject logs rejections, rate-limited per reason (nil: not logged;
	// they are always counted).
	Reject *ratelog.Log
}

// routed is one event to forward: its index in the batch and its request's
// index in the batch's first-seen order.
type routed struct{ event, request int }

type entry struct {
	id  string
	pid *actor.PID
}

// Actor is one engine's actor; its fields are touched only from Receive.
type Actor struct {
	deps     Deps
	epoch    string
	seq      uint64
	haveSeq  bool
	live     map[string]*entry // request id → live request actor
	byPID    map[string]*entry // actor id → entry, live or draining
	retiring bool
	// Scratch of one batch's routing: the requests in first-seen order, each
	// one's event count, and the indexes of the events to forward.
	slot   map[string]int
	order  []string
	counts []int
	fwd    []routed
}

// Props builds an engine actor. Its request actors are stopped, never
// restarted, when they fail.
func Props(deps Deps) *actor.Props {
	return actor.PropsFromProducer(func() actor.Actor {
		return &Actor{deps: deps, live: map[string]*entry{}, byPID: map[string]*entry{},
			slot: map[string]int{}}
	}, actor.WithSupervisor(actors.StopOnPanic(deps.Log)))
}

func (a *Actor) Receive(c actor.Context) {
	switch m := c.Message().(type) {
	case *actor.Started:
		a.deps.Metrics.EnginesLive.Inc()
	case *actor.Stopping, *actor.Restarting:
	case *actor.Stopped:
		a.deps.Metrics.EnginesLive.Dec()
		if a.deps.Closed != nil {
			close(a.deps.Closed)
		}
	case *Batch:
		a.batch(c, m)
	case *request.Done:
		a.done(c, m)
	case *actor.Terminated:
		a.terminated(m)
	case *Retire:
		a.retiring = true
		a.resetAll(c)
		a.maybeStop(c)
	case *StatusQuery:
		a.status(c, m)
	default:
		a.deps.Metrics.Unexpected.WithLabelValues("engine").Inc()
	}
}

// batch applies seq/epoch rules (PROTOCOL.md, "EventBatch") and routes the
// events, in order, one message per request.
func (a *Actor) batch(c actor.Context, m *Batch) {
	b := &m.Batch
	if a.retiring {
		return
	}
	a.deps.Metrics.Batches.Inc()
	if b.Epoch != a.epoch {
		if a.epoch != "" {
			a.deps.Log.Info("engine reset: new epoch", "engine", a.deps.Engine, "old", a.epoch, "new", b.Epoch)
			a.deps.Metrics.EpochResets.Inc()
			a.resetAll(c)
		}
		a.epoch, a.haveSeq = b.Epoch, false
	}
	if a.haveSeq {
		if b.Seq <= a.seq {
			a.deps.Metrics.BatchDuplicate.Inc()
			return
		}
		if b.Seq > a.seq+1 {
			a.deps.Metrics.EventGaps.Inc()
			a.deps.Log.Warn("event gap", "engine", a.deps.Engine, "after", a.seq, "got", b.Seq)
		}
	}
	a.seq, a.haveSeq = b.Seq, true

	for i := range b.Events {
		if ev := &b.Events[i]; a.route(c, m, ev) {
			idx, ok := a.slot[ev.Request]
			if !ok {
				idx = len(a.order)
				a.slot[ev.Request] = idx
				a.order = append(a.order, ev.Request)
				a.counts = append(a.counts, 0)
			}
			a.counts[idx]++
			a.fwd = append(a.fwd, routed{event: i, request: idx})
		}
	}
	a.forward(c, m)
}

// forward copies the routed events into one slice grouped by request (one
// allocation per batch, order kept within each request) and sends each
// request its part. The slice is handed over: the request actors own it.
func (a *Actor) forward(c actor.Context, m *Batch) {
	all := make([]messages.Event, len(a.fwd))
	start := 0
	for idx, n := range a.counts {
		a.counts[idx] = start // now the next free position of request idx
		start += n
	}
	for _, f := range a.fwd {
		all[a.counts[f.request]] = m.Batch.Events[f.event]
		a.counts[f.request]++
	}
	begin := 0
	for idx, id := range a.order {
		end := a.counts[idx]
		if e := a.live[id]; e != nil {
			c.Send(e.pid, &request.Events{Events: all[begin:end:end], Ctx: m.Ctx, Arrived: m.Arrived})
		}
		begin = end
	}
	clear(a.slot)
	a.order, a.counts, a.fwd = a.order[:0], a.counts[:0], a.fwd[:0]
}

// route handles an event that needs the engine (added for a new request,
// finished or anything else for an unknown one) and reports whether the
// event is to be forwarded to its live request actor.
func (a *Actor) route(c actor.Context, m *Batch, ev *messages.Event) bool {
	id := ev.Request
	if _, ok := a.live[id]; !ok {
		switch ev.Type {
		case messages.EvAdded:
			if a.deps.MaxRequests > 0 && len(a.live) >= a.deps.MaxRequests {
				a.deps.Metrics.Rejected.WithLabelValues(actors.ReasonLimit).Inc()
				a.deps.Reject.Reject(actors.ReasonLimit, "added refused: too many live requests", "engine", a.deps.Engine,
					"request", id, "live", len(a.live), "max_requests", a.deps.MaxRequests)
				return false
			}
			a.spawn(c, m.Ctx, ev)
			return false // the added event is the actor's first state
		case messages.EvFinished:
			// PROTOCOL.md: finished for an unknown request is answered with
			// released at once (the engine may be waiting for its blocks).
			reason := messages.ReasonFinished
			if ev.Aborted {
				reason = messages.ReasonAborted
			}
			a.deps.Metrics.Releases.WithLabelValues(reason).Inc()
			a.deps.Outbox.Released(m.Ctx, a.deps.Engine, id, reason)
			return false
		default:
			a.deps.Metrics.Rejected.WithLabelValues(actors.ReasonUnknownReq).Inc()
			a.deps.Reject.Reject(actors.ReasonUnknownReq, "event rejected", "engine", a.deps.Engine, "request", id,
				"type", ev.Type.String(), "err", "unknown request")
			return false
		}
	}
	return true
}

func (a *Actor) spawn(c actor.Context, ctx context.Context, added *messages.Event) {
	if ctx == nil {
		ctx = context.Background()
	}
	pid := c.Spawn(request.Props(a.deps.Request, *added, ctx))
	e := &entry{id: added.Request, pid: pid}
	a.live[added.Request] = e
	a.byPID[pid.Id] = e
}

// done: the request was released for good. The actor is stopped here, by
// its parent, so a Terminated for a pid still live means a failure.
func (a *Actor) done(c actor.Context, m *request.Done) {
	if e := a.live[m.Request]; e != nil && e.pid.Equal(m.PID) {
		delete(a.live, m.Request)
	}
	delete(a.byPID, m.PID.Id)
	c.Stop(m.PID)
	a.maybeStop(c)
}

func (a *Actor) terminated(m *actor.Terminated) {
	e, ok := a.byPID[m.Who.Id]
	if !ok {
		return // stopped after Done: nothing owed
	}
	delete(a.byPID, m.Who.Id)
	if cur := a.live[e.id]; cur == e {
		delete(a.live, e.id)
	}
	// The request actor failed (supervision stopped it). The engine is owed a
	// release so it can reuse the blocks; the request's stores are abandoned.
	a.deps.Metrics.RequestFailure.Inc()
	a.deps.Metrics.Releases.WithLabelValues(messages.ReasonAborted).Inc()
	a.deps.Log.Error("request actor failed; released as aborted", "engine", a.deps.Engine, "request", e.id)
	a.deps.Outbox.Released(context.Background(), a.deps.Engine, e.id, messages.ReasonAborted)
}

// resetAll sends every live request a Reset; they release (engine_reset) once
// their in-flight copies finish and report Done, as before.
func (a *Actor) resetAll(c actor.Context) {
	for id, e := range a.live {
		c.Send(e.pid, &request.Reset{})
		delete(a.live, id)
	}
}

func (a *Actor) maybeStop(c actor.Context) {
	if a.retiring && len(a.byPID) == 0 {
		c.Stop(c.Self())
	}
}

func (a *Actor) status(c actor.Context, m *StatusQuery) {
	st := Status{Engine: a.deps.Engine, Epoch: a.epoch, Seq: a.seq}
	pids := make([]*actor.PID, 0, len(a.live))
	for _, e := range a.live {
		pids = append(pids, e.pid)
	}
	c.Spawn(collectorProps(st, pids, m.Reply))
}
