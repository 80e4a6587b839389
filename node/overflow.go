package node

import (
	"context"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/nats-io/nats.go"

	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/messages"
)

// overflow drops a message the intake cannot hold: a batch makes its engine
// resync; a request gets an error reply.
func (in *ingester) overflow(engineID, verb string, m *nats.Msg) {
	// A batch, heartbeat or register shows the engine alive, dropped or
	// not: an engine must not expire because the node was too busy to read
	// it. (Others may come from routers, a status, or from anyone.) It is
	// alive as of now, not as of when flushLost tells its actor (up to
	// lease/4 later: the lease would stretch by that much).
	batch := verb == messages.VerbEvents
	if batch || verb == messages.VerbHeartbeat || verb == messages.VerbRegister {
		at := in.n.now()
		in.lostMu.Lock()
		if at.After(in.alive[engineID]) {
			in.alive[engineID] = at
		}
		if batch {
			// What its shard held when the batch went: perhaps the
			// engine's register, still to be handled (flushLost).
			q := in.marks[in.shard(engineID)].queued.Load()
			in.lost[engineID] = max(in.lost[engineID], q)
		}
		in.lostMu.Unlock()
		in.anyLost.Store(true)
	}
	if batch {
		in.n.metrics.DroppedBatch(messages.ResyncOverflow).Inc()
		return
	}
	in.n.rejected(messages.RejectOverflow, "request dropped: inbound queue full", "engine", engineID, "verb", verb)
	if !in.n.mayAnswerUnread(engineID, verb) {
		return
	}
	in.n.replyError(context.Background(), m.Reply, errOverloaded)
}

// mayAnswerUnread reports whether this node may answer a request of engine
// it has not read (dropped unread: "node overloaded"). On a cluster every
// node receives every engine's messages, and an engine takes the first
// reply from any node: a busy node that does not serve the engine answering
// its load would have the engine reuse blocks its own node is still
// copying into, and one answering its register would keep it from the OK
// of the node that claims it (the engine retries an overloaded register,
// and loses the race again while the busy node stays busy). So only the
// engine's node answers, as when the message is read (the ownership gate);
// an engine nobody serves yet gets no answer and asks again after its
// timeout. A status is answered by any node (anyone may ask).
func (n *Node) mayAnswerUnread(engine, verb string) bool {
	if n.cl == nil || verb == messages.VerbStatus {
		return true
	}
	return n.cl.owners.Serving(engine, time.Now())
}

// loseAll: nats.go dropped messages of the subscription (slow consumer);
// they name no engine, so every engine resyncs.
func (in *ingester) loseAll() {
	in.n.metrics.DroppedBatch(messages.ResyncOverflow).Inc()
	in.lostMu.Lock()
	in.lostAll = true
	in.lostMu.Unlock()
	in.anyLost.Store(true)
}

// flushLost tells each engine that lost a batch at intake to resync, and
// each whose message intake dropped that it was alive when the latest one
// was dropped. It runs on the workers and the session loop, never on take's
// goroutine.
//
// A loss of an engine not routed yet is kept while its shard has not
// handled every message queued before the batch went (one may be the
// engine's register, which makes its actor; that actor is then told,
// before the engine's next message), or while the engine is parked behind
// its register's claim: its resync says overflow (PROTOCOL.md
// "Delivery"), not the gap its next batch shows. The shard's progress ends
// it on its own: a loss no register came before is forgotten then. (While
// kept it counts as a drop not yet told: every lease check sees a backlog.)
func (in *ingester) flushLost() {
	if !in.anyLost.Load() {
		return
	}
	in.flushing.Add(1)
	defer in.flushing.Add(-1)
	in.lostMu.Lock()
	lost, alive, all := in.lost, in.alive, in.lostAll
	in.lost, in.alive, in.lostAll = map[string]uint64{}, map[string]time.Time{}, false
	in.anyLost.Store(false)
	in.lostMu.Unlock()
	type told struct {
		pid *actor.PID
		msg any
	}
	var tell []told
	var keep map[string]uint64 // losses of engines not routed yet whose register may still come
	in.mu.RLock()
	for id, q := range lost {
		if in.engines[id] == nil && in.mayRoute(id, q) {
			if keep == nil {
				keep = map[string]uint64{}
			}
			keep[id] = q
		}
	}
	for id, pid := range in.engines {
		// On a cluster, only an engine this node still serves: a stale
		// local one must not be kept alive by what its engine sends.
		at := alive[id] // zero: intake dropped no sign of life of it
		if !at.IsZero() && in.n.cl != nil && in.n.cl.owners != nil && !in.n.cl.owners.Serving(id, time.Now()) {
			at = time.Time{}
		}
		_, lostOne := lost[id]
		switch {
		case all || lostOne:
			tell = append(tell, told{pid, &engine.Lost{Reason: messages.ResyncOverflow, AliveAt: at}})
		case !at.IsZero():
			tell = append(tell, told{pid, &engine.Touch{At: at}})
		}
	}
	in.mu.RUnlock()
	if keep != nil {
		in.lostMu.Lock()
		for id, q := range keep {
			in.lost[id] = max(in.lost[id], q)
		}
		in.lostMu.Unlock()
		in.anyLost.Store(true)
	}
	for _, t := range tell {
		in.n.system.Root.Send(t.pid, t.msg)
	}
}

// mayRoute reports whether engine, not routed, may still be: its shard
// has not handled message q (the last queued there when its batch was
// lost), or it is parked behind its register's claim.
func (in *ingester) mayRoute(engine string, q uint64) bool {
	mk := &in.marks[in.shard(engine)]
	return mk.handled.Load() < q || mk.isParked(engine)
}
