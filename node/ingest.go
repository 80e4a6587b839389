package node

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/nats-io/nats.go"

	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/ingest"
	"github.com/kvactors/kvactors/internal/slicepool"
	"github.com/kvactors/kvactors/messages"
)

// ingester serialises each engine's inbound messages. One subscription on
// P.*.* carries every inbound verb (the connection has NoEcho, so the node's
// own publishes never come back), and nats.go calls take for it on one
// goroutine in arrival order; take shards by engine id onto a few workers
// (llm-d's sharded queues), so one engine's register, events, heartbeat,
// status, lookup, load and unregister are handled in the order the engine
// sent them, while different engines decode in parallel.
//
// Intake is bounded in bytes (PROTOCOL.md "Back-pressure"): the bytes taken
// and not yet handled never exceed the budget, and those of the engines
// hashed to one of 64 buckets never exceed three quarters of it: a message
// counts in its bucket only once intake holds more than a quarter (calm),
// and a bucket holds at most half counted (share), so one engine that
// floods leaves the others a quarter. What does not fit is
// dropped and attributed to its engine, which resyncs (reason overflow); a
// request/reply message gets an error reply instead of silence. nats.go's
// own pending queue for the subscription is bounded too (the rest of
// --max-pending-bytes); a drop there names no engine, so every engine
// resyncs.
//
// The budget is also a credit window between intake and the engine actors:
// a batch handed to its engine actor keeps its bytes counted until the actor
// has handled it (engine.Batch.Done), so intake cannot run ahead of the
// actors by more than the budget, and a burst's decoded batches cannot pile
// up in actor mailboxes unbounded. The credits of an engine whose route ends
// are returned then (a stopped actor's mailbox is never handled); those of
// an actor a re-register replaced, as it handles them or once it has
// stopped (route).
type ingester struct {
	n       *Node
	queues  []chan inbound
	marks   []shardMarks // per queue: how far take and the worker have got (backlogged)
	wg      sync.WaitGroup
	mu      sync.RWMutex
	engines map[string]*actor.PID
	hearing map[string]*transfer.Hearing    // per routed engine: when its last message was taken
	credits map[string]map[*credit]struct{} // per engine, under mu

	// taken numbers the messages take has seen (nats.go calls it on one
	// goroutine, in order); lapseEnd is where the last lapse ended in that
	// numbering (stamp).
	taken    uint64
	lapseEnd atomic.Pointer[lapseBoundary]
	sub      *nats.Subscription // the one take serves (markLapseEnd)

	// halt ends the steps off the workers (claimStep) when intake stops.
	halt      context.Context
	haltSteps context.CancelFunc

	gate      sync.RWMutex // take holds it shared; stop exclusively, to close the queues
	stopped   bool
	budget    int64                // bytes the shard queues may hold
	pending   atomic.Int64         // bytes in the shard queues and workers
	buckets   [buckets]bucketBytes // pending again, per bucket of engine ids (bucketOf)
	discarded atomic.Int64         // messages dropped unread after stop
	peak      atomic.Int64         // most pending ever

	lostMu  sync.Mutex
	lost    map[string]uint64    // engines that lost a batch at intake: their shard's queued mark then
	alive   map[string]time.Time // engines a message of which intake dropped: signs of life, the latest drop's time
	lostAll bool                 // nats.go dropped for the subscription
	anyLost atomic.Bool          // lost, alive or lostAll hold something
	// flushing counts flushLost calls between taking those and having sent
	// them to the engine actors (backlogged).
	flushing atomic.Int32
}

// shardMarks say whether a shard holds a message taken and not handled,
// queued or in its worker's hands, without a counter both goroutines write
// per message: take alone writes queued (the number of the last message it
// queued there), the worker alone writes handled (the number of the last it
// finished). Each is its own cache line, read only by the lease check.
type shardMarks struct {
	queued  atomic.Uint64
	_       [56]byte
	handled atomic.Uint64
	_       [56]byte
	lastOK  uint64 // take's own: the last number it queued successfully

	// parked are the engines whose messages wait behind a step off the
	// worker (claimStep): handled as far as the marks go, not yet by their
	// actor. The worker writes it, rarely (a register's claim).
	parkMu sync.Mutex
	parked map[string]bool
}

// queuing marks message n as queued, before take sends it: the worker may
// finish it at once.
func (m *shardMarks) queuing(n uint64) { m.queued.Store(n) }

// sent settles queuing: a message the queue refused goes back off the mark,
// since no worker will mark it handled.
func (m *shardMarks) sent(n uint64, ok bool) {
	if ok {
		m.lastOK = n
		return
	}
	m.queued.Store(m.lastOK)
}

// holding reports whether a message of engine queued is not yet handled:
// any message queued (it names no engine the marks know), or engine's
// parked behind its step. handled is read first: it only grows towards
// queued, so a message queued meanwhile shows as held, never the other
// way; and the worker marks an engine parked before it moves handled past
// the message that parked it.
func (m *shardMarks) holding(engine string) bool {
	handled := m.handled.Load()
	return m.isParked(engine) || m.queued.Load() > handled
}

// queueDepth bounds each shard queue in messages too; the byte budget is
// what normally binds.
const queueDepth = 1 << 14

// inbound is a message with its subject already parsed.
type inbound struct {
	msg          *nats.Msg
	n            uint64 // take's number for it (shardMarks)
	engine, verb string
	// bucket is where its bytes count (noBucket: calm), released there;
	// home is its engine's (bucketOf), where a calm batch moves when its
	// decoded bytes do not fit calm (ingester.admitMore).
	bucket, home uint8
	size         int64
	// taken is when take received it: a batch's arrival, so the time it
	// waits in its shard queue counts in the store latency metrics (a
	// load's or lookup's span starts there too).
	taken time.Time
	// at is when take received it on the node's liveness clock: when the
	// node heard from the engine (transfer.Hearing).
	at time.Time
	// session is the fence generation the message was taken in (stamp).
	session uint64
	// hearing is the engine's transfer.Hearing generation once the message
	// was heard (handle): an epoch it begins belongs to it.
	hearing uint64
}

// lapseBoundary: messages numbered upTo or less were read off the node's
// connection before the round trip that moved the fence to gen (even: a
// lapse ended) completed.
type lapseBoundary struct{ gen, upTo uint64 }

// markLapseEnd runs (transfer.Fence.OnLapseEnding, under the fence's lock)
// just before a round trip ends a lapse, gen being the generation that then
// begins: every message read off the connection before that round trip's
// answer is queued to the subscription by then (nats.go reads in order), so
// those delivered or pending now are the ones that may have waited through
// the lapse. Pending is read first: a message only moves from pending to
// delivered, so the sum can only count too many, never too few: the
// message take is handling is counted in both (nats.go takes it off pending
// once take returns), so the next message read after the lapse ended may be
// taken for the lapse's (safe: one load refused, or one epoch begun
// resyncing).
func (in *ingester) markLapseEnd(gen uint64) {
	if in.sub == nil {
		return
	}
	pending, _, err := in.sub.Pending()
	if err != nil {
		return
	}
	delivered, err := in.sub.Delivered()
	if err != nil {
		return
	}
	in.lapseEnd.Store(&lapseBoundary{gen: gen, upTo: uint64(delivered) + uint64(pending)})
}

// stamp is the fence generation a message numbered n belongs to: now's,
// unless a lapse just ended and the message was read before the round trip
// that ended it (it may have waited in the node's socket through the lapse:
// an engine may have given the node up meanwhile): then the lapse's own
// generation, so its session's copies never start (transfer.Fence.Enter).
func stamp(gen, n uint64, end *lapseBoundary) uint64 {
	if end != nil && gen == end.gen && n <= end.upTo {
		return gen - 1
	}
	return gen
}

func newIngester(n *Node, workers int, budget int64) *ingester {
	in := &ingester{n: n, engines: map[string]*actor.PID{}, credits: map[string]map[*credit]struct{}{},
		budget: budget, lost: map[string]uint64{}, alive: map[string]time.Time{}, hearing: map[string]*transfer.Hearing{}}
	n.metrics.ReadPendingFrom(in.pending.Load)
	n.metrics.ReadFullestBucketFrom(in.fullestBucket)
	in.halt, in.haltSteps = context.WithCancel(context.Background())
	for range workers {
		in.queues = append(in.queues, make(chan inbound, queueDepth))
	}
	in.marks = make([]shardMarks, workers)
	for i := range in.queues {
		in.wg.Add(1)
		go in.work(i)
	}
	return in
}

// route makes pid engineID's actor. The credits of batches the actor it
// replaces has not handled stay counted until it handles them, or until
// replacedEnded is closed (it has stopped: the rest of its mailbox is never
// handled), so a re-register cannot free the budget while those batches
// still wait in memory; nil: returned at once.
func (in *ingester) route(engineID string, pid *actor.PID, h *transfer.Hearing, replacedEnded <-chan struct{}) {
	in.mu.Lock()
	var held map[*credit]struct{}
	if cur := in.engines[engineID]; cur != nil && !cur.Equal(pid) {
		held = in.credits[engineID]
		delete(in.credits, engineID)
	}
	in.engines[engineID] = pid
	in.hearing[engineID] = h
	in.mu.Unlock()
	if len(held) > 0 && replacedEnded != nil {
		go func() {
			<-replacedEnded
			in.returnAll(held)
		}()
		return
	}
	in.returnAll(held)
}

// backlogged reports whether messages taken off NATS may hold signs of
// life engineID's actor has not seen (engine.Deps.Backlogged): its shard
// holds messages queued or in its worker's hands, or nats.go holds messages
// for the subscription that take has not seen (they name no engine yet).
// Read at the lease check only; per message, take and the worker each store
// one number on a line of their own (shardMarks).
//
// The stages are read from the earliest a message is in to the latest
// (the subscription, then the queue and the worker's hands): a message
// moves only forward, so one that moves while they are read is seen at a
// later stage, never missed between two. What the worker has handed over is
// in the engine actor's mailbox, ahead of the check's confirmation.
func (in *ingester) backlogged(engineID string) bool {
	if in.sub != nil {
		if msgs, _, err := in.sub.Pending(); err == nil && msgs > 0 {
			return true
		}
	}
	// Dropped signs of life count (PROTOCOL.md "Engine liveness") until
	// flushLost has sent them on: take drops one before it returns (before
	// Pending lets go of it). anyLost before flushing: flushLost counts
	// itself flushing before it clears anyLost.
	if in.anyLost.Load() || in.flushing.Load() > 0 {
		return true
	}
	return in.marks[in.shard(engineID)].holding(engineID) // queued (marked before the send), in the worker's hands or parked
}

// unroute removes engineID's route if it still points at pid, and returns
// the credits of batches its actor has not handled.
func (in *ingester) unroute(engineID string, pid *actor.PID) {
	in.mu.Lock()
	var held map[*credit]struct{}
	if cur := in.engines[engineID]; cur != nil && cur.Equal(pid) {
		delete(in.engines, engineID)
		delete(in.hearing, engineID)
		held = in.credits[engineID]
		delete(in.credits, engineID)
	}
	in.mu.Unlock()
	in.returnAll(held)
}

// heard records that a message of engineID was taken at at (any message:
// it came from the engine's process, over its link). After a silence of
// lease/2 or more it first tells the engine actor (engine.Silenced), ahead
// of the message itself: the engine may have declared the node lost
// meanwhile, and the message may even be an old one, delivered late. It
// returns the engine's actor (nil: not routed), read under the same lock,
// so a batch needs no second routing lookup.
//
// reset: the actor is told of a silence (engine.Silenced: it resets its
// requests engine_reset and resyncs). An unregister ending a silence does
// not tell it: its retire resets every request engine_gone and counts
// them for the reply, as PROTOCOL.md "P.E.unregister" says; the hearing's
// new generation still keeps every copy begun before the silence from
// starting or going on.
func (in *ingester) heard(engineID string, at time.Time, reset bool) (*actor.PID, uint64) {
	in.mu.RLock()
	h, pid := in.hearing[engineID], in.engines[engineID]
	in.mu.RUnlock()
	if h == nil {
		return pid, 0
	}
	if silent := h.Silent(at); silent >= in.n.cfg.Lease/2 && pid != nil {
		h.Silenced() // before the message: a load ending the silence is refused too
		in.n.metrics.Silences.Inc()
		if reset {
			in.n.system.Root.Send(pid, &engine.Silenced{For: silent})
		}
	}
	h.Heard(at)
	return pid, h.Gen()
}

// msgBytes is what one message holds in memory, near enough: Size is its
// wire size (subject, reply, encoded headers, data; O(1) for a received
// message), and the headers count twice, since nats.go keeps their wire
// bytes beside the parsed map. Headers left out, a message of headers only
// queued nearly for free past --max-pending-bytes.
func msgBytes(m *nats.Msg) int64 {
	size := m.Size()
	hdr := size - len(m.Subject) - len(m.Reply) - len(m.Data)
	return int64(size + hdr + 64)
}

// take is the subscription's handler: parse the subject, admit the message
// within the byte budget, hand it to its engine's shard.
func (in *ingester) take(m *nats.Msg) {
	taken, at := time.Now(), in.n.now() // on receipt: before its admission counts it
	in.taken++                          // every message nats.go delivers, as sub.Delivered counts them (markLapseEnd)
	n := in.taken
	if m.Reply != "" && !messages.ReplyAllowed(m.Reply) {
		// Not answered, not handled, whatever else is wrong with it (a bad
		// subject is answered too): the answer would go out with the
		// node's permissions, on a subject the sender picked. Outbox.Reply
		// refuses it again, for any path that would answer.
		in.n.rejected(messages.RejectBadReply, "reply subject refused", "subject", m.Subject, "reply", m.Reply)
		return
	}
	engineID, verb, err := ingest.ParseSubject(in.n.cfg.Prefix, m.Subject)
	if err != nil {
		in.n.rejected(messages.RejectLabel(err), "bad subject", "subject", m.Subject, "err", err)
		in.n.replyError(context.Background(), m.Reply, err)
		return
	}
	switch verb {
	case messages.VerbReleased, messages.VerbStored, messages.VerbKVEvents, messages.VerbResync:
		return // another node's publish (NoEcho hides only our own): not for us
	}
	if m.Reply != "" && !messages.EngineReplyAllowed(engineID, verb, m.Reply) {
		// An engine's verbs are answered only in its own inbox: the answer
		// goes out with the node's rights, into whichever inbox was named.
		in.n.rejected(messages.RejectBadReply, "reply subject is not the engine's own inbox", "subject", m.Subject,
			"reply", m.Reply)
		return
	}
	size := msgBytes(m)
	h := idHash(engineID) // once, for both its bucket and its shard
	bucket := bucketOf(h)
	in.gate.RLock()
	defer in.gate.RUnlock()
	if in.stopped {
		in.discarded.Add(1)
		return
	}
	counted, ok := in.admit(bucket, size)
	if !ok {
		in.overflow(engineID, verb, m)
		return
	}
	x := inbound{msg: m, n: n, engine: engineID, verb: verb, bucket: counted, home: bucket, size: size, at: at,
		session: stamp(in.n.fence.Gen(), n, in.lapseEnd.Load()), taken: taken}
	i := shardOfHash(h, len(in.queues))
	mk := &in.marks[i]
	mk.queuing(n)
	select {
	case in.queues[i] <- x:
		mk.sent(n, true)
	default:
		mk.sent(n, false)
		in.release(counted, size)
		in.overflow(engineID, verb, m)
	}
}

// shard is the queue of engineID's messages.
func (in *ingester) shard(engineID string) int { return shardOf(engineID, len(in.queues)) }

func shardOf(engineID string, shards int) int { return shardOfHash(idHash(engineID), shards) }

func shardOfHash(h uint32, shards int) int { return int(h % uint32(shards)) }

// bucketOf is the share of the intake budget the engine of id hash h
// counts in (ingester.buckets).
func bucketOf(h uint32) uint8 { return uint8(h % buckets) }

// idHash is FNV-1a (32 bits) of an engine id, computed in place: take
// hashes every message's id once, for its shard and its bucket.
func idHash(engineID string) uint32 {
	const offset32, prime32 = 2166136261, 16777619
	h := uint32(offset32)
	for i := 0; i < len(engineID); i++ {
		h ^= uint32(engineID[i])
		h *= prime32
	}
	return h
}

// handle reports whether the message's bytes went on to an engine actor as
// a credit (returned when it has handled them), or returns the step it
// must wait for off the worker (a register's claim on a cluster: the
// message's bytes stay taken until the step is done). Its bytes, not lent,
// are the caller's to release where x counts then: a batch may have moved
// into its bucket (events).
func (in *ingester) handle(x *inbound) (lent bool, st *claimStep) {
	engineID, m := x.engine, x.msg
	if x.verb != messages.VerbRegister && !in.n.serving(engineID, x.verb) {
		// Another node's engine (clusters): stay silent, counted; unless
		// this node dropped it and nobody owns it now.
		in.n.answerDropped(engineID, x.verb, m)
		return false, nil
	}
	var pid *actor.PID
	switch x.verb {
	case messages.VerbRegister: // compares the silence first (Node.register)
	case messages.VerbStatus: // anyone may ask (routers): no word from the engine
	case messages.VerbEvents, messages.VerbHeartbeat, messages.VerbUnregister, messages.VerbLookup, messages.VerbLoad:
		pid, x.hearing = in.heard(engineID, x.at, x.verb != messages.VerbUnregister)
	default: // an unknown verb is rejected below and changes nothing else: no sign of life
	}
	switch x.verb {
	case messages.VerbEvents:
		return in.events(x, pid), nil
	case messages.VerbRegister:
		return false, in.n.onRegister(engineID, m, x.at)
	case messages.VerbHeartbeat:
		in.n.onHeartbeat(engineID, m, x.hearing)
	case messages.VerbUnregister:
		in.n.onUnregister(engineID, m)
	case messages.VerbStatus:
		in.n.onStatus(engineID, m)
	case messages.VerbLookup:
		in.n.onLookup(engineID, m, x.taken)
	case messages.VerbLoad:
		in.n.onLoad(engineID, m, x.session, x.taken)
	default:
		in.n.rejected(messages.RejectUnknownVerb, "unknown verb", "engine", engineID, "verb", x.verb)
		in.n.replyError(context.Background(), m.Reply, fmt.Errorf("unknown verb %q", x.verb))
	}
	return false, nil
}

// events hands a batch to pid, its engine's actor (nil: not routed).
// x.bucket is updated where the batch moves into its bucket.
func (in *ingester) events(x *inbound, pid *actor.PID) (lent bool) {
	engineID, m, size, arrived := x.engine, x.msg, x.size, x.taken
	n := in.n
	n.metrics.IntakeWait.Observe(time.Since(arrived).Seconds())
	if pid == nil {
		n.rejectedUnknownEngine("events for an unregistered engine", engineID)
		n.replyError(context.Background(), m.Reply, fmt.Errorf("%w %q", errUnknownEngine, engineID))
		return false
	}
	batch, evErrs, err := ingest.DecodeBatchInto(engineID, m.Data, n.cfg.Limits, eventSlices.Get())
	if err != nil {
		n.rejected(messages.RejectLabel(err), "batch rejected", "engine", engineID, "err", err)
		return false
	}
	for i, e := range evErrs {
		reason := messages.RejectLabel(e.Err)
		if i < ingest.DetailedEventErrors {
			n.rejected(reason, "event rejected", "engine", engineID, "request", e.Request,
				"index", e.Index, "type", e.Type, "err", e.Err)
			continue
		}
		// Past those, the decoder counted the batch's other rejections per
		// reason: one Add and one line for each reason, not one per event
		// (a body of junk events would cost a log call each).
		n.rejectedN(reason, e.Count, "more events rejected", "engine", engineID, "count", e.Count,
			"from_index", e.Index, "err", e.Err)
	}
	// The credit is what the batch holds from here on, decoded: a wire
	// byte becomes several (a 120-byte event for ~40 bytes of JSON; a
	// short hash's string header), and the window bounds memory, not JSON.
	credit := max(size, heldBytes(&batch))
	if credit > size {
		counted, ok := in.admitMore(x.bucket, x.home, credit-size, size)
		if !ok {
			eventSlices.Put(batch.Events)
			in.overflow(engineID, x.verb, m) // the engine resyncs, as for a batch dropped at take
			return false
		}
		x.bucket = counted // all its bytes count there now, its size too
	}
	ctx := n.batchCtx(m, engineID, batch.Seq, len(batch.Events))
	msg := &engine.Batch{Batch: batch, Ctx: ctx, Arrived: arrived, Recycle: recycleEvents,
		Session: x.session, Stamped: true, HearingGen: x.hearing}
	if c := in.lend(engineID, x.bucket, pid, credit); c != nil {
		msg.Done, lent = c, true
	} else {
		in.release(x.bucket, credit-size) // the worker releases size
	}
	n.system.Root.Send(pid, msg)
	return lent
}

// eventSlices recycles decoded batches' event slices (engine.Batch.Recycle,
// which hands them back cleared): a batch's events are garbage once its
// requests applied them, and at tens of thousands of batches a second they
// were a large share of what the collector had to clear and scan. A new
// slice holds 64 events (most batches fit); a rare huge batch's (past 1,024)
// is left to the collector.
var eventSlices = slicepool.Pool[messages.Event]{New: 64, Keep: 1024}

// recycleEvents is eventSlices.Put bound once: a method value built per
// batch was a heap allocation per batch.
var recycleEvents = eventSlices.Put

// stop ends intake: the caller has unsubscribed (and drained), so nothing
// more arrives. A step off a worker (a register's claim) is halted and
// waited for, its parked messages handled after it; a register still
// queued is not claimed (the node is going: its engine registers elsewhere).
func (in *ingester) stop() {
	in.gate.Lock()
	in.stopped = true
	in.gate.Unlock()
	in.haltSteps()
	for _, q := range in.queues {
		close(q)
	}
	in.wg.Wait()
}
