package node

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"sync"
	"sync/atomic"
	"time"

	"github.com/asynkron/protoactor-go/actor"

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
	// loadChunks are the chunks of its loads in flight (maxLoadChunks).
	loadChunks atomic.Int64
	// statusGathers are its P.E.status gathers in flight
	// (maxStatusGathersPerEngine).
	statusGathers atomic.Int32
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
	most := namespacesMost(n.cfg.MaxEngines)
	for n.nss.full(id, nsName, most) && n.forgetOldestDeparted() {
		// Under churn the table fills before departed.go forgets ids (it
		// keeps more): the oldest departed go early, with their namespaces.
	}
	if _, err := n.nss.check(id, nsName, lay, most); err != nil {
		return err
	}
	// Implied by HoldsEmpty below (a pool that holds one chunk of each
	// group holds the largest alone: hostpool's
	// TestHoldsEmptyOfOneOfEachImpliesEachFits), so it refuses no engine
	// more; checked first for its plainer answer to the common case, one
	// chunk the pool cannot hold (TestChunkLargerThanPoolRefused).
	if need := lay.MaxChunkBytes(); !n.store.Fits(need) {
		return fmt.Errorf("%w: chunk of %d bytes is larger than the pool can hold (its pages, empty)", ErrRegister, need)
	}
	if sizes, ones := lay.ChunkSizes(), onePerGroup(len(lay.Groups)); !n.store.HoldsEmpty(sizes, ones) {
		// A decision offers no less than a chunk of each group (at a token
		// position every group shares): an engine the empty pool cannot
		// take that of would be refused at every decision, for ever.
		return fmt.Errorf("%w: one chunk of each of its %d groups (%v bytes) is more than the pool can hold at once (its pages and --pool-max-chunks %d, empty)",
			ErrRegister, len(sizes), sizes, n.cfg.PoolMaxChunks)
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
	if err := n.sharesNoObject(old, spec.Segments, attached); err != nil {
		_ = dev.Close()
		return err
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
	lay.Budget = n.stateBudget(id)
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
		Log:     n.log, Closed: rec.closed, Node: n.cfg.NodeID, Boot: n.boot, Lease: n.cfg.Lease,
		Expired: n.expired, Failed: n.failed, Backlogged: func() bool { return n.ingest.backlogged(id) },
		MaxRequests: n.cfg.MaxRequests, Reject: n.rejectLog, Session: n.fence.Gen, Now: n.now,
		Predecessors: n.stillEnding(id), Epochs: n.epochTrail(id),
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
	n.registered.Store(int64(len(n.engines)))
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

func (n *Node) engine(id string) *engineRec {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.engines[id]
}

// onePerGroup is a count of one chunk for each of groups groups.
func onePerGroup(groups int) []int64 {
	ones := make([]int64, groups)
	for i := range ones {
		ones[i] = 1
	}
	return ones
}
