package node

import (
	"context"
	"errors"
	"fmt"
	"reflect"

	"github.com/asynkron/protoactor-go/actor"

	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/ingest"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// engineRec is the node's record of a registered engine.
type engineRec struct {
	id     string
	spec   messages.EngineSpec
	layout *sched.Layout
	device backend.Device
	pid    *actor.PID
	closed chan struct{} // closed when the engine actor stopped
}

// ErrRegister wraps every reason a registration is refused.
var ErrRegister = errors.New("register refused")

// register validates spec, attaches the engine's segments and starts its
// engine actor. An identical spec for a live engine is a no-op; a different
// one retires the old engine actor (an engine reset) and starts a new one.
func (n *Node) register(id string, spec messages.EngineSpec) error {
	// Ownership of segment names before anything is opened (PROTOCOL.md
	// "Isolation"); the backend checks the objects themselves at Attach.
	if err := ingest.CheckOwner(id, &spec); err != nil {
		return fmt.Errorf("%w: %w", ErrRegister, err)
	}
	lay, err := sched.NewLayout(&spec)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrRegister, err)
	}
	nsName := ingest.Namespace(id, &spec)
	n.mu.Lock()
	defer n.mu.Unlock()
	old := n.engines[id]
	if old != nil && reflect.DeepEqual(old.spec, spec) {
		return nil
	}
	if err := n.admit(old, &spec); err != nil {
		return err
	}
	if _, err := n.nss.check(nsName, lay, maxNamespacesPerEngine*n.cfg.MaxEngines); err != nil {
		return err
	}
	if err := n.ensurePool(lay); err != nil {
		return err
	}
	dev, err := n.backend.Attach(id, spec.Segments)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrRegister, err)
	}
	if err := lay.CheckSegments(dev.SegmentSize); err != nil {
		_ = dev.Close()
		return fmt.Errorf("%w: %w", ErrRegister, err)
	}
	n.mapped += len(spec.Segments)
	lay.Namespace = n.nss.commit(nsName, id, lay)
	if old != nil {
		n.log.Info("engine re-registered with a new spec: engine reset", "engine", id)
		n.metrics.EpochResets.Inc()
		n.retire(old)
	}
	rec := &engineRec{id: id, spec: spec, layout: lay, device: dev, closed: make(chan struct{})}
	rec.pid = n.system.Root.Spawn(engine.Props(engine.Deps{
		Engine: id, Outbox: n.outbox, Metrics: n.metrics, Log: n.log.With("engine", id), Closed: rec.closed,
		MaxRequests: n.cfg.MaxRequests, Reject: n.rejectLog,
		Request: request.Deps{Engine: id, Layout: lay, Device: dev, Pool: n.pool, SlotBytes: n.slotBytes,
			Transfer: n.transfer, Outbox: n.outbox, Metrics: n.metrics, Tracer: n.tracer, Log: n.log,
			Namespace: nsName, NamespaceOf: n.namespaceOf, Reject: n.rejectLog},
	}))
	n.engines[id] = rec
	n.ingest.route(id, rec.pid)
	n.log.Info("engine registered", "engine", id, "namespace", nsName, "groups", len(lay.Groups),
		"chunk_bytes", lay.MaxChunkBytes())
	return nil
}

// ensurePool cuts the arena into slots on the first registration: the slot
// is the configured size, or this engine's largest chunk. Later engines must
// fit that slot (their chunks share the pool, and content-addressed keys let
// engines with the same layout load each other's prefixes).
// Caller holds n.mu.
func (n *Node) ensurePool(lay *sched.Layout) error {
	need := lay.MaxChunkBytes()
	if n.pool == nil {
		slot := n.cfg.SlotBytes
		if slot == 0 {
			slot = need
		}
		capacity := n.cfg.PoolBytes / slot
		if capacity < 1 {
			return fmt.Errorf("%w: pool of %d bytes holds no %d-byte chunk", ErrRegister, n.cfg.PoolBytes, slot)
		}
		n.slotBytes = slot
		n.pool = hostpool.NewShared(int(capacity))
		n.log.Info("host pool cut", "slot_bytes", slot, "slots", capacity)
	}
	if need > n.slotBytes {
		return fmt.Errorf("%w: chunk of %d bytes exceeds the pool slot of %d bytes (set --slot-bytes)",
			ErrRegister, need, n.slotBytes)
	}
	return nil
}

// retire tells an engine actor to reset every request and stop; its device
// is closed once it has. Caller holds n.mu.
func (n *Node) retire(rec *engineRec) {
	n.system.Root.Send(rec.pid, &engine.Retire{})
	go func() {
		<-rec.closed
		_ = rec.device.Close()
		n.unmapped(len(rec.spec.Segments))
	}()
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
