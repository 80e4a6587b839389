package node

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/backend/cuda"
	"github.com/kvactors/kvactors/backend/shm"
	"github.com/kvactors/kvactors/disk"
	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/ratelog"
	"github.com/kvactors/kvactors/sched"
	"github.com/kvactors/kvactors/store"
	"github.com/kvactors/kvactors/tracing"
)

// Node is one running kvactors node.
type Node struct {
	cfg     Config
	log     *slog.Logger
	tracer  trace.Tracer
	traced  bool // cfg.Tracer records spans (not nil, not a noop provider): see msgCtx
	metrics *metrics.Metrics
	kv      *kvJournal // kv_events in the order the pool and disk changed

	ns *server.Server // embedded server, nil with --nats
	// embeddedOpts are the embedded server's options (nil with --nats).
	embeddedOpts *server.Options
	storeDir     string // temp JetStream dir to remove, if we made it
	nc           *nats.Conn
	// intakeSub is the intake's subscription once made, for the scrape of
	// the messages nats.go dropped from it (intakeDropped).
	intakeSub atomic.Pointer[nats.Subscription]
	subs      []*nats.Subscription
	slow      slowConsumers // what each subscription's slow-consumer error calls
	outbox    *actors.Outbox

	backend  backend.Backend
	arena    backend.Arena
	store    *store.Store // owns the pool and the arena's contents
	disk     *disk.Disk   // the disk tier; nil without --disk-dir
	diskKeys *diskKeys    // pool keys ↔ the disk's boot-independent keys
	system   *actor.ActorSystem
	transfer *actor.PID
	// copyQueue is the transfer actor's queue; request actors push store jobs to it.
	copyQueue *transfer.Queue
	// claims serialise, per engine id, a register's claim with the release
	// of the claim an ended engine held (releaseClaimIfGone).
	claims keyedLocks

	boot string // random per start (PROTOCOL.md "Node identity")
	// identity is what the node heard of other processes using its id;
	// idSubs its subscriptions (answer, hello, heartbeat), which Close
	// leaves in place: a node shutting down still holds its id.
	identity identity
	idSubs   []*nats.Subscription
	now      func() time.Time // the clock of engine liveness (Config.now)
	owed     atomic.Int64
	fence    *transfer.Fence
	// servingSince is when, on now's clock, the node began to take
	// engines' messages: its first lease is the restart window of
	// rejectedUnknownEngine.
	servingSince time.Time
	// beatStats is what the node heartbeat reports of the pool and disk,
	// gathered off the heartbeat's path (statsLoop).
	beatStats atomic.Pointer[beatStats]
	stop      context.CancelFunc // ends the session loops
	loops     sync.WaitGroup

	mu      sync.Mutex
	engines map[string]*engineRec
	// registered is len(engines), for the heartbeat (beat), which takes no
	// lock; lastBeat is when the last heartbeat was published.
	registered atomic.Int64
	lastBeat   atomic.Pointer[time.Time]
	cleared    map[string]bool // engines that had AllBlocksCleared this boot
	// statusSlots bounds the P.E.status gathers in flight (maxStatusGathers):
	// each holds a goroutine and asks every request actor of its engine.
	statusSlots chan struct{}
	// releases numbers each engine id's releases for the whole boot, across
	// re-registrations, so rseq never restarts within an epoch.
	releases map[string]*actors.Releases
	// ending keeps, per engine id, the Closed channels of its actors that
	// left (retired by a new register, detached) and may still copy: the
	// engine's next actor waits for them before it releases anything
	// (engine.Deps.Predecessors). Pruned of closed ones at each register.
	ending map[string][]<-chan struct{}
	// epochs keeps, per engine id for the whole boot, the epochs its
	// actors began (engine.Deps.Epochs): a re-register's actor takes them
	// in, so a late message of its predecessor's epoch is not a new one.
	epochs map[string]*engine.EpochTrail
	// stateBudgets bounds, per engine id for the whole boot, the bytes of
	// hashes and block ids its live requests hold (--max-request-state-bytes),
	// across its actors: a re-register's requests share it with those its
	// predecessor still holds.
	stateBudgets map[string]*sched.StateBudget
	// departed forgets cleared, releases, epochs and stateBudgets of ids
	// long gone.
	departed departed
	nss      namespaces // isolation: namespace ids and geometry
	mapped   int        // isolation: engine segments mapped now
	// mappedBytes is the isolation bound's count of engine segment bytes
	// mapped now (--max-mapped-bytes): each engine's engineRec.mappedBytes.
	mappedBytes int64
	rejectLog   *ratelog.Log
	// editEngine, when set (tests only, under mu), edits each engine
	// actor's deps before it is spawned: fault injection.
	editEngine func(*engine.Deps)
	// committed, when set (tests only, under mu), is called as a register
	// has made engine a member of namespace ns: the moment the kv_events
	// journal may first publish on it.
	committed func(engine string, ns sched.NamespaceID)
	// diskWalked, when set (tests only, under mu), is called for each
	// record a namespace's first-register disk walk judges (diskFits),
	// under the disk's lock.
	diskWalked func()

	ingest *ingester
	http   *http.Server
	ln     net.Listener
	admin  atomic.Pointer[http.ServeMux] // the admin server's handler: starting, then full
	ready  atomic.Bool
	closed atomic.Bool

	cl *clusterNode // nil unless clustered (node/cluster.go)

	// loadWaits are the loads waiting off the intake for a key pending in
	// another copy (waitLoad); Close closes loadWaitStop, which fails them
	// (the node is closing), and waits for them before the engines retire.
	loadWaits    loadGate
	loadWaitStop chan struct{}
}

// Start brings a node up: NATS, backend and arena, actors, subscriptions,
// admin HTTP. It returns once the node is ready (subscriptions live).
// Cancelling ctx ends the start's waits (the NATS connect, the identity
// probe, the cluster's bucket), and Start returns an error after undoing
// what it did; ctx is not used once Start returns.
func Start(ctx context.Context, cfg Config) (_ *Node, err error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if err := cfg.CheckFiles(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	n := &Node{cfg: cfg, log: cfg.Log, engines: map[string]*engineRec{}, cleared: map[string]bool{},
		statusSlots: make(chan struct{}, maxStatusGathers),
		releases:    map[string]*actors.Releases{}, ending: map[string][]<-chan struct{}{}, epochs: map[string]*engine.EpochTrail{},
		stateBudgets: map[string]*sched.StateBudget{}, boot: newBoot(), now: cfg.now, loadWaitStop: make(chan struct{})}
	n.departed.keep = departedKeep(cfg.MaxEngines)
	if n.now == nil {
		n.now = time.Now
	}
	n.log = n.log.With("node", cfg.NodeID)
	n.rejectLog = ratelog.NewLog(n.log, nil)
	tp := cfg.Tracer
	if tp == nil {
		tp = noop.NewTracerProvider()
	}
	_, noopTP := tp.(noop.TracerProvider)
	n.traced = !noopTP
	n.tracer = tracing.Tracer(tp)
	n.metrics = metrics.New(cfg.Registry)
	n.metrics.Preset(knownLabels())
	metrics.RegisterPool(cfg.Registry, n.poolStats)
	metrics.RegisterIsolation(cfg.Registry, n.mappedNow, n.namespacesNow, n.mappedBytesNow, n.requestStateNow)
	metrics.RegisterIntakeDrops(cfg.Registry, n.intakeDropped)
	defer func() {
		if err != nil {
			n.teardown()
		}
	}()
	n.kv = newKVJournal(n.publishKV, n.kvTarget)
	n.kv.held = n.namespacesHeld
	n.kv.linger = max(0, cfg.KVEventsLinger)
	if cfg.kvDeferMost > 0 {
		n.kv.deferred = newKVDeferred(cfg.kvDeferMost)
	}
	kvm := metrics.RegisterKVJournal(cfg.Registry, n.kv.pending)
	n.kv.onDefer = func(deferred, dropped int) {
		kvm.Deferred.Add(float64(deferred))
		kvm.DeferredDropped.Add(float64(dropped))
	}
	if err := n.listenHTTP(); err != nil { // a port in use fails here, not after the NATS wait
		return nil, err
	}
	if err := n.startBackend(); err != nil {
		return nil, err
	}
	if err := n.connect(ctx); err != nil {
		return nil, err
	}
	if max := n.nc.MaxPayload(); cfg.MaxPendingBytes < 4*max {
		// nats.go's half of the budget must hold two of the largest messages,
		// or a single large batch or request would always be dropped there.
		return nil, fmt.Errorf("%w: --max-pending-bytes %d: want at least %d (4 × the NATS server's max payload, %d)",
			ErrConfig, cfg.MaxPendingBytes, 4*max, max)
	}
	// Before the cluster reads its previous boots' engines (a live process
	// holding this id is not a previous boot) and before the fence's clock
	// starts (the probe can take a lease). The answer first, so a process
	// starting with this id while this one starts finds it.
	if err := n.watchIdentity(); err != nil {
		return nil, err
	}
	if err := n.probeIdentity(ctx); err != nil {
		return nil, err
	}
	n.outbox = actors.NewOutbox(n.nc, cfg.Prefix, n.log)
	// The reply rule's one chokepoint: a reply refused there is counted
	// and logged as the intake's own refusal is.
	n.outbox.OnRefusedReply(func(reply string) {
		n.rejected(messages.RejectBadReply, "reply subject refused at the outbox", "reply", reply)
	})
	n.outbox.OnPublishFailed(func(kind string) { n.metrics.PublishFailures.WithLabelValues(kind).Inc() })
	n.kv.bodyMax = n.outbox.BodyMax // a server's max_payload under 512 KiB cuts kv_events smaller
	n.fence = transfer.NewFence(cfg.Lease, time.Now, n.metrics.FenceWaits.Inc)
	n.fence.OnLapse(n.lapsed)
	n.fence.OnLapseEnd(n.lapseEnded)
	libLog := slog.New(minLevel{Handler: n.log.Handler(), min: slog.LevelWarn}).With("lib", "protoactor")
	n.system = actor.NewActorSystem(actor.WithLoggerFactory(func(*actor.ActorSystem) *slog.Logger { return libLog }))
	if err := n.startCluster(ctx); err != nil {
		return nil, err
	}
	n.kv.start() // after the cluster's stamp: every kv_events message carries it
	n.copyQueue = transfer.NewQueue(cfg.Transfer, n.metrics.Transfer)
	tcfg := cfg.Transfer
	tcfg.EngineSilence = cfg.Lease / 2 // transfer.Hearing: an engine whose own link failed
	n.transfer = n.system.Root.Spawn(transfer.Props(transfer.Deps{Config: tcfg,
		Metrics: n.metrics.Transfer, Unexpected: n.metrics.Unexpected.WithLabelValues(actors.KindTransfer), Tracer: n.tracer, Log: n.log, Fence: n.fence,
		Queue: n.copyQueue, Now: n.now}))
	n.servingSince = n.now() // before any handler can read it
	if err := n.subscribe(); err != nil {
		return nil, err
	}
	n.serveAdmin()
	n.warnExposure(n.embeddedOpts)
	n.hello()
	loops, stop := context.WithCancel(context.Background())
	n.stop = stop
	n.loops.Add(4)
	go n.statsLoop(loops)
	go n.sessionLoop(loops)
	go n.pinger(loops)
	go n.watchdog(loops)
	if n.cl != nil {
		keepAlive, stopKeepAlive := context.WithCancel(loops)
		n.cl.stopKeepAlive, n.cl.keepAliveDone = stopKeepAlive, make(chan struct{})
		n.loops.Add(1)
		go n.ownershipLoop(keepAlive, n.cl.keepAliveDone)
	}
	n.ready.Store(true)
	n.log.Info("kvactors ready", "boot", n.boot, "cluster", cfg.Clustered(), "standby_for", cfg.StandbyFor, "lease", cfg.Lease, "nats", n.NATSURL(), "prefix", cfg.Prefix, "backend", n.backend.Name(),
		"pool_bytes", cfg.PoolBytes, "http", n.HTTPAddr())
	return n, nil
}

// Run starts a node and serves until ctx is cancelled, then shuts down.
func Run(ctx context.Context, cfg Config) error {
	n, err := Start(ctx, cfg)
	if err != nil {
		return err
	}
	<-ctx.Done()
	return n.Close(context.Background())
}

func (n *Node) startBackend() error {
	var err error
	switch n.cfg.Backend {
	case "cuda":
		n.backend, err = cuda.New(cuda.Config{Device: n.cfg.CUDADevice})
	default:
		n.backend, err = shm.New(shm.Config{Dir: n.cfg.ShmDir})
	}
	if err != nil {
		return fmt.Errorf("backend %s: %w", n.cfg.Backend, err)
	}
	if n.arena, err = n.backend.AllocArena(n.cfg.PoolBytes); err != nil {
		return fmt.Errorf("allocate pool arena of %d bytes: %w", n.cfg.PoolBytes, err)
	}
	if n.cfg.DiskDir != "" {
		if n.disk, err = disk.Open(disk.Config{Dir: n.cfg.DiskDir, Bytes: n.cfg.DiskBytes, MaxChunks: int64(n.cfg.DiskMaxChunks), Log: n.log}, n.diskChanged); err != nil {
			return fmt.Errorf("disk tier: %w", err)
		}
		metrics.RegisterDisk(n.cfg.Registry, n.disk.Stats)
		st := n.disk.Stats()
		n.log.Info("disk tier opened", "dir", n.cfg.DiskDir, "chunks", st.Chunks, "bytes", st.Bytes,
			"discarded", st.Discarded)
	}
	n.store = store.New(n.arena, n.cfg.PoolPageBytes, n.disk, n.metrics.Pool)
	n.store.SetMaxChunks(n.cfg.PoolMaxChunks)
	n.store.SetJournal(n.kv.pool)
	n.diskKeys = newDiskKeys()
	n.store.UseDiskKeys(n.diskKeys)
	if n.cfg.SlotBytes != 0 {
		n.log.Warn("--slot-bytes is deprecated and ignored: the pool takes any chunk size", "slot_bytes", n.cfg.SlotBytes)
	}
	return nil
}

// HTTPAddr is the admin server's bound address ("" when off).
func (n *Node) HTTPAddr() string {
	if n.ln == nil {
		return ""
	}
	return n.ln.Addr().String()
}

// Ready reports whether the node is connected and subscribed (/readyz).
func (n *Node) Ready() error {
	switch {
	case !n.ready.Load():
		return errors.New("starting or stopping")
	case !n.nc.IsConnected():
		return errors.New("nats not connected")
	case n.fence.Fenced():
		return errors.New("fenced: no NATS round trip for lease/2, copies wait")
	}
	if err := n.identityConflict(); err != nil {
		return err
	}
	for _, subs := range [][]*nats.Subscription{n.subs, n.idSubs} {
		for _, s := range subs {
			if !s.IsValid() {
				return fmt.Errorf("subscription %s not valid", s.Subject)
			}
		}
	}
	if h, ok := n.backend.(interface{ Healthy() error }); ok {
		if err := h.Healthy(); err != nil {
			return fmt.Errorf("backend: %w", err)
		}
	}
	return nil
}

// Arena is the pool's memory (read by the demo's integrity check through
// the load path's slots; exported for tests).
func (n *Node) Arena() backend.Arena { return n.arena }

// Store is the node's store (exported for tests: the corruption tests reach
// into the pool's bytes through it).
func (n *Node) Store() *store.Store { return n.store }

// Disk is the node's disk tier, nil without --disk-dir (exported for tests).
func (n *Node) Disk() *disk.Disk { return n.disk }

func (n *Node) poolStats() hostpool.Stats {
	if n.store == nil { // set once in Start, before the admin server runs
		return hostpool.Stats{}
	}
	return n.store.Stats()
}

// ErrUndelivered: Close's timeout expired with releases not yet published
// (or not flushed to NATS).
var ErrUndelivered = errors.New("shutdown timed out with releases undelivered")

// Boot is this process's boot id.
func (n *Node) Boot() string { return n.boot }

// NodeID is this node's id.
func (n *Node) NodeID() string { return n.cfg.NodeID }

// Close shuts down gracefully, in this order: stop taking events (drain the
// subscriptions), fail the loads waiting for a key another copy is filling
// (waitLoad), retire every engine (queued copies cancelled, in-flight
// copies finish, pending releases published), stop the actors, flush and
// close NATS, stop the embedded server, stop HTTP, free the arena. If the
// shutdown timeout expires first, it still tears down and returns an error
// wrapping ErrUndelivered that says how many releases were not delivered.
func (n *Node) Close(ctx context.Context) error {
	if !n.closed.CompareAndSwap(false, true) {
		return nil
	}
	n.ready.Store(false)
	ctx, cancel := context.WithTimeout(ctx, n.cfg.ShutdownTimeout)
	defer cancel()
	unapplied := n.drainIntake(ctx) // inbound messages dropped unread: the node never knew what they said
	if n.ingest != nil {
		n.ingest.stop()
		unapplied += n.ingest.discarded.Load()
	}
	// No load comes in any more: those waiting for a pending key fail now
	// (a remote load's fetch that ends later is refused as closing).
	close(n.loadWaitStop)
	n.loadWaits.closeAndWait()
	sentBefore := int64(0)
	if n.outbox != nil {
		sentBefore = n.outbox.Releases()
	}
	n.retireAll(ctx)
	// The releases are what engines are owed: confirm them now, before a
	// cluster's closed markers, which wait on JetStream (a quorum lost, no
	// answer) and would leave the final flush no time. What this flush
	// confirms is not counted below, whatever becomes of NATS after it.
	if n.outbox != nil && n.nc != nil && n.nc.IsConnected() {
		if published := n.outbox.Releases(); n.nc.FlushWithContext(ctx) == nil {
			sentBefore = published
		}
	}
	n.closeCluster(ctx)
	n.kv.close() // what the pool and disk changed so far is announced
	// From here on nothing is published: the count below stays true.
	var undelivered, unconfirmed int64
	if n.outbox != nil {
		undelivered = n.outbox.Seal(n.owed.Load)
	}
	if n.nc != nil {
		// Published is not delivered until the server has it; with NATS down,
		// waiting out the timeout would not change that. Nor does an empty
		// client buffer prove it: what was written out just before the link
		// failed is lost with it.
		flushed := n.nc.IsConnected() && n.nc.FlushWithContext(ctx) == nil
		if !flushed && n.outbox != nil {
			unconfirmed = n.outbox.Releases() - sentBefore
		}
	}
	if n.stop != nil {
		n.stop()
	}
	if n.fence != nil {
		n.fence.Close()
	}
	n.teardown()
	n.loops.Wait()
	if unapplied > 0 {
		// Batches the node never read may hold requests it never knew: no
		// release is counted for those; the engine frees them on node loss.
		n.log.Warn("shutdown: inbound messages dropped unread", "unapplied_messages", unapplied)
	}
	if undelivered > 0 || unconfirmed > 0 {
		n.log.Error("shutdown timed out with releases undelivered", "undelivered_releases", undelivered,
			"unconfirmed_releases", unconfirmed, "unapplied_messages", unapplied, "timeout", n.cfg.ShutdownTimeout)
		return fmt.Errorf("%w: %d releases never published, %d published during shutdown but not confirmed by NATS",
			ErrUndelivered, undelivered, unconfirmed)
	}
	return nil
}

// drainIntake drains the intake's subscriptions for Close: what NATS
// already handed the client is still taken, so a batch that arrived before
// the shutdown is applied, not lost. With NATS down there is nothing to
// drain, and a drain would wait out its timeout for an answer that cannot
// come: a subscription is unsubscribed at once if the connection is down,
// or as soon as it goes down mid-drain (a link cut just before Close, not
// yet seen by the client when the drain began, held a shutdown for
// ShutdownTimeout/4). It returns how many messages were dropped unread.
func (n *Node) drainIntake(ctx context.Context) (unapplied int64) {
	if len(n.subs) == 0 {
		return 0
	}
	down, unwatch := n.watchDown()
	defer unwatch()
	for _, s := range n.subs {
		closed := s.StatusChanged(nats.SubscriptionClosed)
		stop := func() {
			if msgs, _, err := s.Pending(); err == nil {
				unapplied += int64(msgs)
			}
			_ = s.Unsubscribe()
		}
		if !n.nc.IsConnected() || drainSub(s) != nil { // checked after down's registration: no loss unseen
			stop()
			continue
		}
		drained := time.NewTimer(n.cfg.ShutdownTimeout / 4) // leave most of the time to the releases
		select {
		case <-closed:
		case <-down:
			stop()
		case <-drained.C:
			stop()
		case <-ctx.Done():
			stop()
		}
		drained.Stop()
	}
	return unapplied
}

// watchDown reports the NATS connection going down (disconnected,
// reconnecting, closed) on down until unwatch, which closes it. Registered
// before a caller checks IsConnected, it misses no loss after that check.
func (n *Node) watchDown() (down <-chan nats.Status, unwatch func()) {
	ch := n.nc.StatusChanged(nats.DISCONNECTED, nats.RECONNECTING, nats.CLOSED)
	return ch, func() { n.nc.RemoveStatusListener(ch) }
}

// drainSub starts the drain of an intake subscription in Close (a seam: a
// test starts one that never ends).
var drainSub = (*nats.Subscription).Drain

// stopTransfer stops the transfer actor and waits for its workers to
// finish the copies they hold, for transferStopWait at most; false if one
// was still running then.
func (n *Node) stopTransfer() bool {
	n.system.Root.Stop(n.transfer)
	wait := transferStopWait(n.cfg.Lease)
	t := time.NewTimer(wait)
	defer t.Stop()
	// The watchdog has stopped with the node's loops, and no heartbeat goes
	// out since the outbox was sealed: the engines' leases run out as the
	// fence's does. A copy still running 5/8 lease past the last round trip
	// fail-stops the process here as it would have there.
	check := time.NewTicker(n.cfg.Lease / 8)
	defer check.Stop()
	for {
		select {
		case <-n.copyQueue.Exited():
			// The rest of its stop (answering the loads left, the Drains
			// waiting) follows at once: waited for on the queue, not with
			// a protoactor future, whose registration and 10 s timer kept
			// the whole actor system alive past Close.
			select {
			case <-n.copyQueue.Stopped():
			case <-time.After(10 * time.Second):
				n.log.Error("shutdown: the transfer actor's stop did not finish after its copies ended")
			}
			return true
		case <-check.C:
			if n.fence != nil && n.fence.Overdue(time.Now()) {
				n.cfg.FailStop("shutdown: a device copy is running 5/8 of a lease after the last NATS round trip")
				return false
			}
		case <-t.C:
			n.log.Error("shutdown: the transfer actor's copies did not end", "waited", wait)
			return false
		}
	}
}

// transferStopWait is how long shutdown waits for running copies: past
// the fence's bound on a copy with no round trip (lease/2, the pinger is
// stopped by then), with room. A variable for tests.
var transferStopWait = func(lease time.Duration) time.Duration { return max(time.Minute, 2*lease) }

func (n *Node) closeConnections() {
	if n.nc != nil {
		// No flush: Close has flushed and counted what NATS did not
		// confirm (a failed Start owes nothing), and nc.Close still writes
		// out its buffer. A flush here waited 2 s past the shutdown
		// timeout for a link gone silent.
		n.nc.Close()
	}
	if n.ns != nil {
		n.ns.Shutdown()
		n.ns.WaitForShutdown()
	}
	if n.storeDir != "" {
		_ = os.RemoveAll(n.storeDir)
	}
}

func (n *Node) teardown() {
	n.kv.close() // a failed Start; after Close's, a no-op
	if n.cl != nil && n.cl.feed != nil && !n.closed.Load() {
		n.cl.feed.Close() // a failed Start
	}
	if n.http != nil {
		_ = n.http.Close()
	}
	copiesOut := true
	if n.system != nil {
		// The transfer actor first, and waited for: its workers may be in a
		// copy that reads engine segments and writes the arena, both freed
		// below (ActorSystem.Shutdown does not stop actors).
		if n.transfer != nil {
			copiesOut = n.stopTransfer()
		}
		n.system.Shutdown()
	}
	if !copiesOut {
		// Freeing under a running copy would fault the process or let the
		// copy write into memory mapped again; what is left mapped goes
		// with the process.
		n.log.Error("shutdown: a copy still running; engine segments, the arena, the disk tier and the backend are left as they are")
		n.closeConnections()
		return
	}
	if n.disk != nil { // after the actors (no more spills): the writer drains its queue (announcements after the seal are not sent)
		n.disk.Close()
	}
	n.closeConnections()
	n.mu.Lock()
	for _, e := range n.engines {
		_ = e.device.Close()
	}
	n.mapped, n.mappedBytes = 0, 0 // a retiring engine's goroutine may still subtract: harmless at teardown
	n.engines = map[string]*engineRec{}
	n.registered.Store(0)
	n.mu.Unlock()
	if n.arena != nil {
		_ = n.arena.Close()
	}
	// The cuda backend holds a context, streams and locked OS threads (and
	// the mappings of engines retired but not yet unmapped) until its
	// Close; shm holds nothing of its own.
	if c, ok := n.backend.(io.Closer); ok {
		if err := c.Close(); err != nil {
			n.log.Error("close the backend", "backend", n.cfg.Backend, "err", err)
		}
	}
}
