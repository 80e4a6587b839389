package request

import (
	"context"
	"slices"
	"sync/atomic"

	"github.com/asynkron/protoactor-go/actor"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/messages"
)

// Spawner starts an engine's request actors. A released actor (Done) is
// not stopped but kept idle, up to MaxIdle per engine, and the next added
// request is given to it (assign): one actor still serves one live request,
// but a request no longer pays protoactor's spawn and stop — a process
// registry insert and delete into 32k small maps, the Started, Stopping,
// Stopped and Terminated messages — which were about a sixth of the node's
// CPU with nothing to store (docs/BENCHMARKS.md, sixth session).
//
// New actors come from one Props, so a live request costs the heap its own
// state and protoactor's per-actor records, not a Props and a producer
// closure of its own. Each actor runs on actors.InlineMailbox: on the
// goroutine that posts to it while it is idle (the engine actor's turn for
// its events, the transfer actor's for its JobDone), so one engine step is
// one unit of work with no goroutine hand-off per request; one runner at a
// time, as with any mailbox.
//
// A Spawner is used from one actor's turn at a time (its engine's).
// protoactor calls the producer inside Spawn, and again only to restart a
// failed actor, which the engine's supervisor never does (it stops them:
// actors.StopOnPanic); were it to, the failed instance settles its
// accounts on Restarting (live gauge, owed count, span) and the restarted
// one stops itself at once rather than run on state it no longer has; its
// engine releases the request as failed (as for any request actor that
// stops unreleased).
type Spawner struct {
	props *actor.Props
	next  *Actor
	idle  []*actor.PID // released actors, the most recent last
	// isIdle holds idle's ids: Forget is called for every stopped request
	// actor, and past MaxIdle every release stops one, so a miss must not
	// scan idle.
	isIdle map[string]struct{}
}

// MaxIdle bounds the released actors an engine keeps for reuse. An idle
// actor holds no request state (dropped at its release), only protoactor's
// records and its deps, so 512 cost an engine under half a MiB; 64 were too
// few for the store-heavy bench, whose finished requests are released in
// waves as copies complete (spawns were 2.9% of the node's CPU with 64,
// 1.6% with 512).
const MaxIdle = 512

// NewSpawner makes an engine's Spawner.
func NewSpawner() *Spawner {
	s := &Spawner{isIdle: map[string]struct{}{}}
	s.props = actor.PropsFromProducer(func() actor.Actor {
		a := s.next
		s.next = nil
		if a == nil {
			return unexpectedRestart{}
		}
		return a
	}, actor.WithMailbox(actors.InlineMailbox))
	return s
}

// Spawn gives the request of added an actor, a child of c: an idle one if
// there is one, else a new one. parent carries the batch context that
// created it, and deps is shared (read only) by the engine's requests of one
// epoch.
func (s *Spawner) Spawn(c SpawnContext, deps *Deps, added *messages.Event, parent context.Context) *actor.PID {
	return s.SpawnWatched(c, deps, added, parent, nil)
}

// SpawnWatched is Spawn with a flag the request raises, with its reason,
// just before it publishes its final release (nil: none).
func (s *Spawner) SpawnWatched(c SpawnContext, deps *Deps, added *messages.Event, parent context.Context,
	releasing *Releasing) *actor.PID {
	if n := len(s.idle); n > 0 {
		pid := s.idle[n-1]
		s.idle[n-1], s.idle = nil, s.idle[:n-1]
		delete(s.isIdle, pid.Id)
		// By value: the batch's events are recycled after the step, and an
		// idle actor busy with a stale timer would take this after it.
		c.Send(pid, &assign{deps: deps, added: *added, parent: parent, releasing: releasing})
		return pid
	}
	s.next = newActor(deps, added, parent, releasing)
	return c.Spawn(s.props)
}

// Release takes back the actor of a request that reported Done: it waits
// for the next Spawn, or is stopped when MaxIdle already wait.
func (s *Spawner) Release(c actor.Context, pid *actor.PID) {
	if len(s.idle) < MaxIdle {
		s.idle = append(s.idle, pid)
		s.isIdle[pid.Id] = struct{}{}
		return
	}
	c.Stop(pid)
}

// Forget drops pid from the idle actors (it stopped: Terminated).
func (s *Spawner) Forget(pid *actor.PID) {
	if _, ok := s.isIdle[pid.Id]; !ok {
		return
	}
	delete(s.isIdle, pid.Id)
	for i, p := range s.idle {
		if p.Equal(pid) {
			s.idle = slices.Delete(s.idle, i, i+1)
			return
		}
	}
}

// Idle is how many released actors wait for reuse.
func (s *Spawner) Idle() int { return len(s.idle) }

// SpawnContext is what Spawn needs of its caller: to spawn, and to send an
// idle actor its request (an actor.Context, or a RootContext in tests).
type SpawnContext interface {
	actor.SpawnerContext
	actor.SenderContext
}

// assign gives an idle (released) actor its next request.
type assign struct {
	deps      *Deps
	added     messages.Event
	parent    context.Context
	releasing *Releasing
}

// Releasing is raised by a request actor just before it publishes its final
// release, with that release's reason (SpawnWatched): one plain write and one
// atomic store per request. Each is raised at most once.
type Releasing struct {
	up     atomic.Bool
	reason string // written before up is raised; read only once up is seen
	// raised, when set (CountIn), counts each raise, after up: the engine
	// looks for raised flags only once it has moved.
	raised *atomic.Uint64
}

// CountIn makes each raise of r add one to n, once r is up. Set before the
// request's actor is given r.
func (r *Releasing) CountIn(n *atomic.Uint64) { r.raised = n }

func (r *Releasing) raise(reason string) {
	r.reason = reason
	r.up.Store(true)
	if r.raised != nil {
		r.raised.Add(1)
	}
}

// Load reports whether the final release is going out (or went out).
func (r *Releasing) Load() bool { return r.up.Load() }

// Reason is the final release's reason once Load reports true ("" before,
// and for a final step that released nothing).
func (r *Releasing) Reason() string {
	if !r.up.Load() {
		return ""
	}
	return r.reason
}

// unexpectedRestart stands in for a request actor protoactor restarted;
// see Spawner.
type unexpectedRestart struct{}
