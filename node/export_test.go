package node

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvactors/kvactors/cluster"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// Seams for the node_test package, compiled with the tests only.

// RecordLapse records a lapse now, as the watchdog does once no round trip
// has completed for 3/4 lease (transfer.Fence.Check at a time that far
// past the last one): a test with a long lease gets a lapse at a moment of
// its choosing, with no session tick near it.
func (n *Node) RecordLapse() { n.fence.Check(time.Now().Add(n.cfg.Lease)) }

// Ping makes one round trip with NATS as the pinger does (its error: the
// flush failed, and the fence was told nothing); after a lapse it ends it.
func (n *Node) Ping() error { return n.ping() }

// HoldIntake stops the intake's take before it stamps a message with the
// fence generation (the lock its stop takes), as a descheduled NATS
// subscription goroutine would, until release.
func (n *Node) HoldIntake() (release func()) {
	n.ingest.gate.Lock()
	return sync.OnceFunc(n.ingest.gate.Unlock)
}

// HoldKVJournal holds the kv_events journal's lock until release: whoever
// adds to it meanwhile (the disk tier announcing a change, under its own
// lock) waits.
func (n *Node) HoldKVJournal() (release func()) {
	n.kv.mu.Lock()
	return sync.OnceFunc(n.kv.mu.Unlock)
}

// WithKVDeferBound bounds the kv_events changes the journal defers for
// namespaces with no member (Config.kvDeferMost).
func WithKVDeferBound(most int) func(*Config) {
	return func(c *Config) { c.kvDeferMost = most }
}

// WithLoadChunksBound bounds the chunks of an engine's loads in flight
// (Config.loadChunksMost).
func WithLoadChunksBound(most int64) func(*Config) {
	return func(c *Config) { c.loadChunksMost = most }
}

// WithLoadBuilt calls f as each load's chunks are built (Config.loadBuilt).
func WithLoadBuilt(f func(chunks int, held int64)) func(*Config) {
	return func(c *Config) { c.loadBuilt = f }
}

// WithClock sets the node's liveness clock (Config.now): engine expiry and
// the engine-silence fence read it.
func WithClock(now func() time.Time) func(*Config) {
	return func(c *Config) { c.now = now }
}

// HoldInClusterGate holds the next of the node's cluster gates' holders to
// reach gate ("read": readChunk serving a fetch; "fetch": a remote load's
// fetch allocating a chunk's room; "fetched": a remote load whose fetch is
// done, before it pins its keys; "claim-released": an ended engine's claim just
// released) until release; entered is closed once
// one is held there. Set it before the node serves or loads.
func (n *Node) HoldInClusterGate(gate string) (entered <-chan struct{}, release func()) {
	in, out := make(chan struct{}), make(chan struct{})
	var once sync.Once
	f := func(g string) {
		if g != gate {
			return
		}
		held := false
		once.Do(func() { held = true; close(in) })
		if held {
			<-out
		}
	}
	n.cl.inGate.Store(&f)
	return in, sync.OnceFunc(func() { close(out) })
}

// HoldAllInClusterGate holds every holder of the node's cluster gates to
// reach gate (as HoldInClusterGate names them, and "remote-load": a remote
// load's goroutine as it starts, before its fetch) until release; entered
// receives once per holder held (up to its buffer of most). Set it before
// the node loads.
func (n *Node) HoldAllInClusterGate(gate string, most int) (entered <-chan struct{}, release func()) {
	in, out := make(chan struct{}, most), make(chan struct{})
	f := func(g string) {
		if g != gate {
			return
		}
		in <- struct{}{}
		<-out
	}
	n.cl.inGate.Store(&f)
	return in, sync.OnceFunc(func() { close(out) })
}

// StallClaim holds the next claim of engine's registers as it begins,
// before its JetStream calls, as a stalled JetStream would (a KV leader
// election), until release or the claim's own context ends (its lease, or
// the intake's stop); entered receives once it is held, left once it lets
// go. Set it before the register arrives.
func (n *Node) StallClaim(engine string) (entered, left <-chan struct{}, release func()) {
	in, gone, out := make(chan struct{}, 1), make(chan struct{}, 1), make(chan struct{})
	var once sync.Once
	f := func(ctx context.Context, id string) {
		if id != engine {
			return
		}
		held := false
		once.Do(func() { held = true })
		if !held {
			return
		}
		in <- struct{}{}
		defer func() { gone <- struct{}{} }()
		select {
		case <-out:
		case <-ctx.Done():
		}
	}
	n.cl.onClaim.Store(&f)
	return in, gone, sync.OnceFunc(func() { close(out) })
}

// IntakeShard is the intake shard (decode worker) of engine's messages.
func (n *Node) IntakeShard(engine string) int { return n.ingest.shard(engine) }

// IntakePending is the bytes the intake holds now: taken, not yet handled
// (parked ones included), or lent to engine actors.
func (n *Node) IntakePending() int64 { return n.ingest.pending.Load() }

// IntakeBuckets is what the intake's buckets hold now, summed, and how many
// hold anything: both 0 once every message and credit is given back, to the
// bucket it was admitted to.
func (n *Node) IntakeBuckets() (bytes int64, held int) {
	f := map[string]int{}
	n.ingest.footprintBytes(f)
	return int64(f["ingest_bucket_bytes"]), f["ingest_buckets_held"]
}

// ClusterNamespace is the namespace key a fetch from another node names
// for an engine of spec in namespace name (messages.ClusterNamespace with
// the spec's geometry fingerprint).
func ClusterNamespace(engine, name string, spec *messages.EngineSpec) string {
	lay, err := sched.NewLayout(spec)
	if err != nil {
		panic(err)
	}
	return messages.ClusterNamespace(messages.NamespaceKey(engine, name), geometry(lay))
}

// MaxCopyingLoads is maxCopyingLoads, for tests outside the package.
const MaxCopyingLoads = maxCopyingLoads

// DroppedHere reports whether this cluster node remembers having dropped
// engine id (it answers the engine's heartbeats "unknown engine" while no
// node owns it).
func (n *Node) DroppedHere(id string) bool {
	n.cl.dropped.mu.Lock()
	defer n.cl.dropped.mu.Unlock()
	return n.cl.dropped.ids[id] != nil
}

// HoldStatusGathers takes every P.E.status gather slot until release: a
// status request meanwhile is refused (limit).
func (n *Node) HoldStatusGathers() (release func()) {
	for range maxStatusGathers {
		n.statusSlots <- struct{}{}
	}
	return sync.OnceFunc(func() {
		for range maxStatusGathers {
			<-n.statusSlots
		}
	})
}

// FillIntake takes the intake's whole byte budget until release: a request
// meanwhile is dropped unread and answered "overloaded".
func (n *Node) FillIntake(t *testing.T) (release func()) {
	taken := takeWholeBudget(t, n.ingest)
	return sync.OnceFunc(func() { freeTotal(n.ingest, taken) })
}

// NATSServerID is the id of the NATS server the node is connected to (its
// client randomizes the servers it is given).
func (n *Node) NATSServerID() string { return n.nc.ConnectedServerId() }

// SetSubscriptionDrain replaces how Close starts the drain of the intake's
// subscription, until the returned func restores it: a drain that does not
// call Drain never ends.
func SetSubscriptionDrain(drain func(*nats.Subscription) error) (restore func()) {
	old := drainSub
	drainSub = drain
	return func() { drainSub = old }
}

// SetLeave replaces how Close leaves a closed marker for an engine it
// owns, until the returned func restores it.
func SetLeave(leave func(o *cluster.Owners, ctx context.Context, engine string) error) (restore func()) {
	old := leaveEngine
	leaveEngine = leave
	return func() { leaveEngine = old }
}

// SetTransferStopWait sets how long Close waits for running copies, until
// the returned func restores it.
func SetTransferStopWait(d time.Duration) (restore func()) {
	old := transferStopWait
	transferStopWait = func(time.Duration) time.Duration { return d }
	return func() { transferStopWait = old }
}

// ShardOf is the intake shard of engineID among shards.
func ShardOf(engineID string, shards int) int { return shardOf(engineID, shards) }

// NamespacesHeld is how many namespaces the node's table holds now.
func (n *Node) NamespacesHeld() int { return n.namespacesNow() }
