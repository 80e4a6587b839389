package node

// An engine's end: unregistered, expired or failed, its actor retired,
// its device unmapped once no copy or load uses it, and the engine's next
// registration waiting for what is still ending.

import (
	"context"
	"fmt"
	"slices"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/nats-io/nats.go"

	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// leaving notes that rec's actor no longer serves its engine but may still
// copy until rec.closed: the engine's next actor waits for it
// (stillEnding). Caller holds n.mu.
func (n *Node) leaving(rec *engineRec) {
	n.ending[rec.id] = append(n.stillEnding(rec.id), rec.closed)
	go func() { // an engine that never registers again leaves no entry behind
		<-rec.closed
		n.mu.Lock()
		if n.stillEnding(rec.id) == nil && n.engines[rec.id] == nil {
			n.departedLocked(rec.id)
		}
		n.mu.Unlock()
	}()
}

// stillEnding prunes and returns engine id's left actors that have not
// closed yet. Caller holds n.mu.
func (n *Node) stillEnding(id string) []<-chan struct{} {
	open := n.ending[id][:0]
	for _, ch := range n.ending[id] {
		select {
		case <-ch:
		default:
			open = append(open, ch)
		}
	}
	if len(open) == 0 {
		delete(n.ending, id)
		return nil
	}
	n.ending[id] = open
	return slices.Clone(open)
}

// epochTrail is engine id's EpochTrail for the boot, made at its first
// register. Caller holds n.mu.
func (n *Node) epochTrail(id string) *engine.EpochTrail {
	t := n.epochs[id]
	if t == nil {
		t = &engine.EpochTrail{}
		n.epochs[id] = t
	}
	return t
}

// stateBudget is engine id's --max-request-state-bytes budget, one for
// the boot (Node.stateBudgets). Caller holds n.mu.
func (n *Node) stateBudget(id string) *sched.StateBudget {
	b := n.stateBudgets[id]
	if b == nil {
		b = sched.NewStateBudget(n.cfg.MaxRequestStateBytes)
		n.stateBudgets[id] = b
	}
	return b
}

// retire tells an engine actor to reset every request and stop; its device
// is closed once it has. Caller holds n.mu.
func (n *Node) retire(rec *engineRec) {
	n.system.Root.Send(rec.pid, &engine.Retire{})
	go n.unmapWhenClosed(rec)
}

// unmapWhenClosed closes an engine's device once its actor has stopped and
// its loads have ended: never under a copy.
func (n *Node) unmapWhenClosed(rec *engineRec) {
	<-rec.closed
	rec.loads.closeAndWait()
	if err := n.unmap(rec); err != nil {
		// Nobody waits for this close to answer (a reset, an expiry, an
		// end that timed out): the log is where a device's failure shows.
		n.log.Error("unmap segments of a retired engine", "engine", rec.id, "err", err)
	}
}

// unmap closes an engine's device and gives its segments and bytes back to
// --max-mapped-segments and --max-mapped-bytes (isolation).
func (n *Node) unmap(rec *engineRec) error {
	err := rec.device.Close()
	n.unmapped(len(rec.spec.Segments), rec.mappedBytes)
	return err
}

// detach removes engine id from the node (new messages for it are refused as
// for an unknown engine) if pid is nil or still its actor.
func (n *Node) detach(id string, pid *actor.PID) *engineRec {
	n.mu.Lock()
	defer n.mu.Unlock()
	rec := n.engines[id]
	if rec == nil || (pid != nil && !rec.pid.Equal(pid)) {
		return nil
	}
	delete(n.engines, id)
	n.registered.Store(int64(len(n.engines)))
	n.nss.leave(id)
	n.ingest.unroute(id, rec.pid)
	n.leaving(rec)
	return rec
}

// end retires a detached engine for good (PROTOCOL.md "P.E.unregister"):
// every request released engine_gone (queued copies cancelled, in-flight
// ones finished first), then the segments unmapped. It returns how many
// requests were released, once all of that is done or ctx ends. retired,
// when not nil, is the count of a retire the engine actor began itself (a
// failure: engine.Deps.Failed), and no retire is sent.
func (n *Node) end(ctx context.Context, rec *engineRec, retired <-chan int) (int, error) {
	count := retired
	if count == nil {
		c := make(chan int, 1)
		n.system.Root.Send(rec.pid, &engine.Retire{Reason: messages.ReasonEngineGone, Reset: c})
		count = c
	}
	select {
	case <-rec.closed:
	case <-ctx.Done():
		go n.unmapWhenClosed(rec)
		return 0, fmt.Errorf("engine %q: requests or copies still in flight: %w", rec.id, ctx.Err())
	}
	released := 0
	select {
	case released = <-count: // sent just before the actor stopped
	default:
	}
	rec.loads.closeAndWait()
	if err := n.unmap(rec); err != nil {
		return released, fmt.Errorf("unmap segments of %q: %w", rec.id, err)
	}
	return released, nil
}

// onUnregister answers P.E.unregister once the engine's requests are
// released and its segments unmapped (awaited off the ingest worker).
func (n *Node) onUnregister(engineID string, m *nats.Msg) {
	ctx := n.msgCtx(m)
	rec := n.detach(engineID, nil)
	if rec == nil {
		n.rejectedUnknownEngine("unregister of an unknown engine", engineID)
		n.replyError(ctx, m.Reply, fmt.Errorf("%w %q", errUnknownEngine, engineID))
		return
	}
	n.metrics.Unregistered.Inc()
	go func() {
		released, err := n.endForGood(rec, nil)
		if err != nil {
			n.log.Error("unregister", "engine", engineID, "err", err)
			n.replyError(ctx, m.Reply, err)
			return
		}
		n.log.Info("engine unregistered", "engine", engineID, "released", released)
		n.outbox.Reply(ctx, m.Reply, messages.UnregisterReply{OK: true, Released: released, Node: n.cfg.NodeID,
			Boot: n.boot})
	}()
}

// expired is the engine actor's report that the engine's lease ran out: it
// ends exactly as an unregister does, with no one to reply to. Only that
// actor's engine ends: one registered again meanwhile, under a new actor,
// is alive (false: the report is stale).
func (n *Node) expired(engineID string, pid *actor.PID) bool {
	rec := n.detach(engineID, pid)
	if rec == nil {
		return false
	}
	n.metrics.Expired.Inc()
	go func() {
		released, err := n.endForGood(rec, nil)
		if err != nil {
			n.log.Error("expire", "engine", engineID, "err", err)
			return
		}
		n.log.Info("engine expired and released", "engine", engineID, "released", released)
	}()
	return true
}

// failed is the engine actor's report that it failed (a panic in one of
// its turns) and is ending its engine: the node forgets the engine (it is
// unknown from now on: its heartbeat is refused, so it registers again and
// resyncs), returns the credits of batches the actor will not handle (the
// failed one's among them), and, as for an expiry, unmaps its segments and
// gives up its claim once every request is released. released is the
// actor's own retire's count (nil: it was retiring already). Only that
// actor's engine ends: one registered again meanwhile lives on.
func (n *Node) failed(engineID string, pid *actor.PID, released <-chan int) {
	rec := n.detach(engineID, pid)
	if rec == nil {
		return // retired already (unregister, expiry, new spec): that end goes on
	}
	go func() {
		count, err := n.endForGood(rec, released)
		if err != nil {
			n.log.Error("end a failed engine", "engine", engineID, "err", err)
			return
		}
		n.log.Warn("failed engine ended: requests released engine_gone", "engine", engineID, "released", count)
	}()
}

// endForGood ends a detached engine that leaves this node (unregister,
// expiry, failure), bounded by the shutdown timeout, and gives up its
// cluster claim unless it registered again: at once, or, if copies outlive
// the timeout, once its actor has stopped (never a claim renewed for an
// engine this node no longer serves). retired is as for end.
func (n *Node) endForGood(rec *engineRec, retired <-chan int) (int, error) {
	wait, cancel := context.WithTimeout(context.Background(), n.cfg.ShutdownTimeout)
	defer cancel()
	released, err := n.end(wait, rec, retired)
	if err != nil {
		go n.releaseClaimWhenClosed(rec)
		return released, err
	}
	n.releaseClaimIfGone(rec.id)
	return released, nil
}

// retireAll retires every engine and waits (bounded by ctx) until each has
// published its releases.
func (n *Node) retireAll(ctx context.Context) {
	n.mu.Lock()
	recs := make([]*engineRec, 0, len(n.engines))
	for _, rec := range n.engines {
		n.system.Root.Send(rec.pid, &engine.Retire{})
		recs = append(recs, rec)
	}
	n.mu.Unlock()
	for _, rec := range recs {
		select {
		case <-rec.closed:
		case <-ctx.Done():
			n.log.Warn("shutdown: engine did not retire in time", "engine", rec.id)
			return
		}
	}
}
