package node

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/nats-io/nats.go"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/ingest"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
	"github.com/kvactors/kvactors/store"
)

// engineRec is the node's record of a registered engine.
type engineRec struct {
	id     string
	spec   messages.EngineSpec
	layout *sched.Layout
	device backend.Attachment
	// attached is device as the backend made it, under the node's and the
	// tests' wrappers: what recheck asks.
	attached backend.Attachment
	// mappedBytes is what its device counts against --max-mapped-bytes
	// (mapCharge), given back when the device is closed.
	mappedBytes int64
	store       *store.Engine
	pid         *actor.PID
	closed      chan struct{} // closed when the engine actor stopped
	loads       loadGate      // loads copying into the device
	// hearing is when the node last took a message of the engine off NATS:
	// its copies stop after lease/2 of silence (transfer.Hearing).
	hearing *transfer.Hearing
	// clusterNS is clusterNamespace's, made once: every lookup asks it.
	clusterNS string
	// waitingLoads are its loads waiting for pending keys (maxWaitingLoads).
	waitingLoads atomic.Int32
	// copyingLoads are its loads pinned and queued or copying
	// (maxCopyingLoads).
	copyingLoads atomic.Int32
}

// loadGate counts an engine's loads in flight and, once the engine is
// ending, refuses new ones: a load taken on an ingest worker may race the
// engine's expiry (decided on its actor's goroutine), and a load let in
// after the wait began would copy into segments being unmapped.
type loadGate struct {
	mu      sync.Mutex
	closing bool
	wg      sync.WaitGroup
}

// enter counts a load in, unless the engine is ending.
func (g *loadGate) enter() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closing {
		return false
	}
	g.wg.Add(1)
	return true
}

// leave counts a load out.
func (g *loadGate) leave() { g.wg.Done() }

// closeAndWait refuses new loads and waits for those in flight.
func (g *loadGate) closeAndWait() {
	g.mu.Lock()
	g.closing = true
	g.mu.Unlock()
	g.wg.Wait()
}

// namespace is the engine's namespace as its registered spec names it (the
// engine id when it names none): the spec the node serves, never one it
// refused.
func (r *engineRec) namespace() string { return ingest.Namespace(r.id, &r.spec) }

// namespaceKey is the engine's namespace as the node, the disk tier and the
// cluster key it (messages.NamespaceKey).
func (r *engineRec) namespaceKey() string { return messages.NamespaceKey(r.id, r.namespace()) }

// clusterNamespace is the engine's namespace as the cluster keys it: its
// key qualified by its geometry (messages.ClusterNamespace). Each node fixes
// a namespace's geometry for its own boot only, so the engine counts and
// fetches only chunks stored under its own geometry.
func (r *engineRec) clusterNamespace() string { return r.clusterNS }

// ErrRegister wraps every reason a registration is refused.
var ErrRegister = errors.New("register refused")

// register validates spec, attaches the engine's segments and starts its
// engine actor. An identical spec for a live engine is a no-op; a different
// one retires the old engine actor (an engine reset) and starts a new one.
func (n *Node) register(id string, spec messages.EngineSpec, at time.Time) error {
	// Ownership of segment names before anything is opened (PROTOCOL.md
	// "Isolation"); the backend checks the objects themselves at Attach.
	if err := ingest.CheckOwner(id, &spec); err != nil {
		return fmt.Errorf("%w: %w", ErrRegister, err)
	}
	lay, err := sched.NewLayout(&spec)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrRegister, err)
	}
	// A spec that asks for more than the node lets one request hold is
	// refused; one that asks for nothing (its bound derived from
	// num_gpu_blocks) is bounded by the node's (PROTOCOL.md "Isolation").
	if spec.MaxModelLen > n.cfg.MaxModelLen {
		return fmt.Errorf("%w: max_model_len %d is more than this node's %d (--max-model-len)",
			ErrLimit, spec.MaxModelLen, n.cfg.MaxModelLen)
	}
	lay.CapModelLen(int64(n.cfg.MaxModelLen))
	// Only the span of each segment that regions use is mapped, and a
	// segment no region uses is refused (docs/SECURITY.md).
	spans, err := segmentSpans(lay, len(spec.Segments))
	if err != nil {
		return fmt.Errorf("%w: %w", ErrRegister, err)
	}
	charge, err := n.mapCharge(spans)
	if err != nil {
		return err
	}
	nsName := ingest.Namespace(id, &spec)
	// diskWalk, when set, re-announces a namespace's chunks on disk once
	// n.mu is let go, before the register is answered (see reannounceDisk).
	var diskWalk func()
	n.mu.Lock()
	defer func() {
		n.mu.Unlock()
		if diskWalk != nil {
			diskWalk()
		}
	}()
	old := n.engines[id]
	silentFor := time.Duration(0)
	if old != nil {
		silentFor = old.hearing.Silent(at)
	}
	// why a register of a live engine is an engine reset; "" while it is not.
	why := ""
	switch {
	case old == nil:
	case !reflect.DeepEqual(old.spec, spec):
		why = "engine re-registered with a new spec: engine reset"
	case silentFor >= n.cfg.Lease/2:
		// After lease/2 of silence the engine may have declared this node
		// lost (its own link failed) and reused the blocks its requests
		// held: they must never copy again, so its register is a reset even
		// with the same spec (PROTOCOL.md "Fencing, node side").
		why = "engine re-registered after a silence of lease/2 or more: engine reset"
	case recheck(old.attached) != nil:
		// A restarted engine recreated its object under the same name: the
		// mapping holds the dead process's memory, so the same spec is
		// remapped as a new one (PROTOCOL.md "EngineSpec").
		why = "engine re-registered with a segment object replaced: engine reset"
	default:
		old.hearing.Heard(at)
		n.system.Root.Send(old.pid, &engine.Touch{})
		return nil
	}
	if err := n.admit(old, &spec, charge); err != nil {
		return err
	}
	if _, err := n.nss.check(id, nsName, lay, maxNamespacesPerEngine*n.cfg.MaxEngines); err != nil {
		return err
	}
	if need := lay.MaxChunkBytes(); !n.store.Fits(need) {
		return fmt.Errorf("%w: chunk of %d bytes is larger than the pool can hold (its pages, empty)", ErrRegister, need)
	}
	var dev backend.Attachment
	if sa, ok := n.backend.(backend.SpanAttacher); ok {
		dev, err = sa.AttachSpans(id, spec.Segments, spans)
	} else {
		dev, err = n.backend.Attach(id, spec.Segments)
	}
	if err != nil {
		return fmt.Errorf("%w: %w", ErrRegister, err)
	}
	attached := dev // the backend's own, for recheck
	if n.cfg.WrapDevice != nil {
		dev = n.cfg.WrapDevice(dev)
	}
	dev = n.ownedDevice(id, dev) // clusters: no copy once the claim may have lapsed
	if err := lay.CheckSegments(dev.SegmentSize); err != nil {
		_ = dev.Close()
		return fmt.Errorf("%w: %w", ErrRegister, err)
	}
	n.mapped += len(spec.Segments)
	n.mappedBytes += charge
	if !n.cleared[id] {
		// PROTOCOL.md v2 "Register reply": the first register of an engine in
		// a boot clears what routers believed this node held, before anything
		// else is published for the engine (its actor does not exist yet).
		// Published (into the connection's ordered buffer) before commit
		// makes the engine a kv_events target: the journal's goroutine reads
		// targets under nss.mu, not n.mu, and may publish on the engine as
		// soon as commit returns.
		n.cleared[id] = true
		n.outbox.AllBlocksCleared(context.Background(), id)
	}
	ns := n.nss.commit(nsName, id, lay)
	// Changes to the namespace's keys deferred while it had no member go
	// out on it now, after the AllBlocksCleared above and before anything
	// else of the namespace (PROTOCOL.md "kv_events").
	n.kv.joined(id, ns.id)
	if n.committed != nil {
		n.committed(id, ns.id)
	}
	lay.Namespace = ns.id
	if prefix, first := n.diskKeys.learn(ns.id, ns.key, lay); first && n.disk != nil {
		// The namespace's first engine in this boot: routers may still
		// believe its DISK chunks of the last boot (torn records cut at
		// rebuild, another --disk-dir), and know nothing of those this
		// boot found on disk, visible from now on. Clear and tell them,
		// on the namespace's member only (PROTOCOL.md "kv_events").
		n.kv.cleared(id, ns.id, messages.MediumDisk)
		keep := n.diskFits(lay)
		diskWalk = func() { n.reannounceDisk(nsName, prefix, keep) }
	}
	if old != nil {
		n.log.Info(why, "engine", id, "silent", silentFor)
		n.metrics.EpochResets.Inc()
		n.retire(old)
		n.leaving(old)
	}
	rel := n.releases[id]
	if rel == nil {
		rel = actors.NewReleases(n.outbox, id)
		n.releases[id] = rel
	}
	rec := &engineRec{id: id, spec: spec, layout: lay, device: dev, attached: attached, mappedBytes: charge, store: n.store.Engine(id, lay, dev),
		closed: make(chan struct{}), hearing: &transfer.Hearing{}}
	rec.clusterNS = messages.ClusterNamespace(rec.namespaceKey(), geometry(lay))
	rec.hearing.Heard(at)
	deps := engine.Deps{
		Engine: id, Outbox: n.outbox, Releases: rel,
		Metrics: engine.NewMetrics(n.metrics.Engines, n.metrics.Events, n.metrics.Store, n.metrics.Actors),
		Log:     n.log.With("engine", id), Closed: rec.closed, Node: n.cfg.NodeID, Boot: n.boot, Lease: n.cfg.Lease,
		Expired: n.expired, Failed: n.failed, Backlogged: func() bool { return n.ingest.backlogged(id) },
		MaxRequests: n.cfg.MaxRequests, Reject: n.rejectLog, Session: n.fence.Gen, Now: n.now,
		Predecessors: n.stillEnding(id),
		Request: request.Deps{Engine: id, Layout: lay, Store: rec.store,
			Metrics:  request.NewMetrics(n.metrics.Events, n.metrics.Store, n.metrics.Actors),
			Transfer: n.transfer, Queue: n.copyQueue, Outbox: n.outbox, Tracer: n.tracer, Log: n.log, Owed: &n.owed,
			Reject: n.rejectLog, Timers: actors.NewTimers(n.system.Root, n.metrics.Store.RetriesPending),
			Hearing: rec.hearing},
	}
	if n.editEngine != nil {
		n.editEngine(&deps)
	}
	rec.pid = n.system.Root.Spawn(engine.Props(deps))
	n.engines[id] = rec
	var replacedEnded <-chan struct{}
	if old != nil {
		replacedEnded = old.closed
	}
	n.ingest.route(id, rec.pid, rec.hearing, replacedEnded)
	n.log.Info("engine registered", "engine", id, "namespace", nsName, "groups", len(lay.Groups),
		"chunk_bytes", lay.MaxChunkBytes())
	return nil
}

// recheck is nil while every segment's name still names the object dev
// attached (backend.Rechecker); a backend that cannot tell passes.
func recheck(dev backend.Attachment) error {
	if rc, ok := dev.(backend.Rechecker); ok {
		return rc.Recheck()
	}
	return nil
}

// leaving notes that rec's actor no longer serves its engine but may still
// copy until rec.closed: the engine's next actor waits for it
// (stillEnding). Caller holds n.mu.
func (n *Node) leaving(rec *engineRec) {
	n.ending[rec.id] = append(n.stillEnding(rec.id), rec.closed)
	go func() { // an engine that never registers again leaves no entry behind
		<-rec.closed
		n.mu.Lock()
		n.stillEnding(rec.id)
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
	_ = n.unmap(rec)
}

// unmap closes an engine's device and gives its segments and bytes back to
// --max-mapped-segments and --max-mapped-bytes (isolation).
func (n *Node) unmap(rec *engineRec) error {
	err := rec.device.Close()
	n.unmapped(len(rec.spec.Segments), rec.mappedBytes)
	return err
}

// segmentSpans is the span of each segment that lay's regions use, as the
// backend takes it (sched, pure logic, does not import backend: the two
// Span types have the same fields, so each converts directly).
func segmentSpans(lay *sched.Layout, segments int) ([]backend.Span, error) {
	ss, err := lay.Spans(segments)
	if err != nil {
		return nil, err
	}
	spans := make([]backend.Span, len(ss))
	for i, s := range ss {
		spans[i] = backend.Span(s)
	}
	return spans, nil
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
		n.rejected(messages.RejectUnknownEngine, "unregister of an unknown engine", "engine", engineID)
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

func (n *Node) engine(id string) *engineRec {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.engines[id]
}
