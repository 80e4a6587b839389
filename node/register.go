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
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
	"github.com/kvactors/kvactors/store"
)

// engineRec is the node's record of a registered engine.
type engineRec struct {
	id     string
	spec   messages.EngineSpec
	layout *sched.Layout
	device backend.Device
	store  *store.Engine
	pid    *actor.PID
	closed chan struct{} // closed when the engine actor stopped
}

// ErrRegister wraps every reason a registration is refused.
var ErrRegister = errors.New("register refused")

// register validates spec, attaches the engine's segments and starts its
// engine actor. An identical spec for a live engine is a no-op; a different
// one retires the old engine actor (an engine reset) and starts a new one.
func (n *Node) register(id string, spec messages.EngineSpec) error {
	lay, err := sched.NewLayout(&spec)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrRegister, err)
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	old := n.engines[id]
	if old != nil && reflect.DeepEqual(old.spec, spec) {
		return nil
	}
	if need := lay.MaxChunkBytes(); !n.store.Fits(need) {
		return fmt.Errorf("%w: chunk of %d bytes is larger than the pool", ErrRegister, need)
	}
	dev, err := n.backend.Attach(id, spec.Segments)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrRegister, err)
	}
	if err := lay.CheckSegments(dev.SegmentSize); err != nil {
		_ = dev.Close()
		return fmt.Errorf("%w: %w", ErrRegister, err)
	}
	if old != nil {
		n.log.Info("engine re-registered with a new spec: engine reset", "engine", id)
		n.metrics.EpochResets.Inc()
		n.retire(old)
	}
	rec := &engineRec{id: id, spec: spec, layout: lay, device: dev, store: n.store.Engine(id, lay, dev),
		closed: make(chan struct{})}
	rec.pid = n.system.Root.Spawn(engine.Props(engine.Deps{
		Engine: id, Outbox: n.outbox, Metrics: n.metrics, Log: n.log.With("engine", id), Closed: rec.closed,
		Request: request.Deps{Engine: id, Layout: lay, Store: rec.store,
			Transfer: n.transfer, Outbox: n.outbox, Metrics: n.metrics, Tracer: n.tracer, Log: n.log},
	}))
	n.engines[id] = rec
	n.ingest.route(id, rec.pid)
	n.log.Info("engine registered", "engine", id, "groups", len(lay.Groups), "chunk_bytes", lay.MaxChunkBytes())
	return nil
}

// retire tells an engine actor to reset every request and stop; its device
// is closed once it has. Caller holds n.mu.
func (n *Node) retire(rec *engineRec) {
	n.system.Root.Send(rec.pid, &engine.Retire{})
	go func() {
		<-rec.closed
		_ = rec.device.Close()
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
