package node

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/actors/load"
	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/ingest"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
	"github.com/kvactors/kvactors/store"
	"github.com/kvactors/kvactors/tracing"
)

// onLookup answers P.E.lookup: the hit tokens of a hash prefix. Its span
// starts at taken, when intake took the message, so the wait behind the
// engine's earlier messages is in it, as it is in the engine's.
func (n *Node) onLookup(engineID string, m *nats.Msg, taken time.Time) {
	ctx := n.msgCtx(m)
	n.metrics.Lookups.Inc()
	rec := n.engine(engineID)
	if rec == nil {
		n.rejectedUnknownEngine("lookup of an unregistered engine", engineID)
		n.replyError(ctx, m.Reply, fmt.Errorf("%w %q", errUnknownEngine, engineID))
		return
	}
	hashes, err := ingest.DecodeLookup(m.Data, n.cfg.Limits)
	if err != nil {
		n.rejected(messages.RejectLabel(err), "lookup refused", "subject", m.Subject, "err", err)
		n.replyError(ctx, m.Reply, err)
		return
	}
	// The reply goes out in the span's context: it is the node's work
	// that answers (PROTOCOL.md), not the engine's span passed back.
	ctx, span := n.verbSpan(ctx, tracing.SpanLookup, engineID, taken)
	defer span.End()
	ns := rec.clusterNamespace()
	hit := rec.layout.HitTokens(hashes, func(k messages.Key) bool {
		return rec.store.Ready(k) || n.heldElsewhere(ns, k) // of the engine's chunk size: what its load takes
	})
	if span.IsRecording() {
		span.SetAttributes(tracing.AttrHashes.Int(len(hashes)), tracing.AttrHitTokens.Int(hit))
	}
	if hit > 0 {
		n.metrics.LookupHits.Inc()
		n.metrics.HitTokens.Add(float64(hit))
	}
	n.outbox.Reply(ctx, m.Reply, messages.LookupReply{HitTokens: hit, Node: n.cfg.NodeID, Boot: n.boot})
}

// verbSpan starts a lookup's or a load's span at taken, a child of ctx's
// (the engine's) span. With tracing off it starts none: a no-op span's
// options still cost allocations per request. It returns ctx's span then
// (the engine's, not recording, or none), whose span context a no-op
// tracer's span would have had too: a reply carries the same traceparent.
func (n *Node) verbSpan(ctx context.Context, name, engineID string, taken time.Time) (context.Context, trace.Span) {
	if !n.traced {
		return ctx, trace.SpanFromContext(ctx)
	}
	return n.tracer.Start(ctx, name, trace.WithTimestamp(taken),
		trace.WithAttributes(tracing.AttrEngine.String(engineID)))
}

// onLoad starts P.E.load: the keys are pinned here, then a load actor runs
// the copy and answers once it completed.
// errLoadAfterSilence refuses a load between an engine's silence of lease/2
// and its next epoch.
var errLoadAfterSilence = errors.New("engine was silent for lease/2 or more: no load until it begins a new epoch (resync)")

func (n *Node) onLoad(engineID string, m *nats.Msg, session uint64, taken time.Time) {
	// The load's span covers the whole load from taken (intake took the
	// message: its wait behind the engine's earlier messages is the
	// engine's wait too), so a refusal, a remote fetch and a wait for
	// pending keys are inside it: fail ends it with an error, or the load
	// actor ends it (load.Job.Span).
	ctx, span := n.verbSpan(n.msgCtx(m), tracing.SpanLoad, engineID, taken)
	var heldChunks *atomic.Int64 // the engine's loadChunks this load counts in, until it ends
	var held int64
	end := func(err error, level slog.Level, reason string) {
		if heldChunks != nil {
			heldChunks.Add(-held)
		}
		n.metrics.Loads.WithLabelValues(load.ResultError).Inc()
		// Rate-limited: an engine chooses how many loads fail (docs/SECURITY.md).
		n.rejectLog.Log(level, reason, "load refused", "engine", engineID, "err", err)
		n.replyError(ctx, m.Reply, err)
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
		span.End()
	}
	fail := func(err error) {
		level, reason := slog.LevelError, "load_error"
		switch label := messages.RejectLabel(err); {
		case errors.Is(err, hostpool.ErrNotReady):
			level, reason = slog.LevelInfo, "load_miss" // evicted or never stored: a miss, not bad input
		case label != messages.RejectOther:
			reason = label // a refusal counted where it was found (tryLoad's limit): its line says so too
		}
		end(err, level, reason)
	}
	// refuse is fail for bad input: counted by reason as a lookup's is,
	// and logged with that reason, so the line is found by the label.
	refuseAt := func(level slog.Level, err error) {
		reason := messages.RejectLabel(err)
		n.metrics.Rejected.WithLabelValues(reason).Inc()
		end(err, level, reason)
	}
	refuse := func(err error) { refuseAt(slog.LevelError, err) }
	rec := n.engine(engineID)
	if rec == nil {
		refuseAt(n.unknownEngineLevel(), fmt.Errorf("%w %q", errUnknownEngine, engineID))
		return
	}
	gen := rec.hearing.Gen() // before the check: a silence ending meanwhile refuses the copy
	if rec.hearing.LoadsRefused() {
		// PROTOCOL.md "Engine silence": it may be a load sent before the
		// engine declared this node lost, delivered late into blocks the
		// engine has reused; its next epoch (the resync) lifts this.
		fail(errLoadAfterSilence)
		return
	}
	req, err := ingest.DecodeLoad(m.Data, n.cfg.Limits)
	if err != nil {
		refuse(err)
		return
	}
	if span.IsRecording() {
		span.SetAttributes(tracing.AttrRequest.String(req.Request))
	}
	// Counted until the load ends (end, or its load actor's Done), before
	// its chunks are built: one that does not fit the room its engine's
	// other loads leave is refused having built, pinned or fetched nothing.
	most := n.loadChunksMost()
	count, err := rec.layout.LoadChunkCount(req.Hashes, req.NumTokens, req.Blocks, int(most))
	if err != nil {
		refuse(err)
		return
	}
	held = int64(count)
	if rec.loadChunks.Add(held) > most {
		rec.loadChunks.Add(-held)
		refuse(fmt.Errorf("load %q: %w", req.Request, errTooManyLoadChunks(most)))
		return
	}
	heldChunks = &rec.loadChunks
	chunks, err := rec.layout.LoadChunksCounted(req.Hashes, req.NumTokens, req.Blocks, count)
	if err != nil {
		refuse(err) // not for a body just counted: a bug
		return
	}
	if n.cfg.loadBuilt != nil {
		n.cfg.loadBuilt(len(chunks), rec.loadChunks.Load())
	}
	keys := make([]messages.Key, len(chunks))
	for i := range chunks {
		keys[i] = chunks[i].Key
	}
	if remote := n.remoteKeys(rec, keys); len(remote) > 0 {
		// Fetching takes round trips: off the ingest worker, holding the
		// device open as a load does, and counted in the engine's loads in
		// flight (maxCopyingLoads) from here: a goroutine, its fetches and
		// their pool room each, which one engine must not start without
		// bound. The count is let go as the fetch ends and taken again by
		// tryLoad, so it never holds two.
		if rec.copyingLoads.Add(1) > maxCopyingLoads {
			rec.copyingLoads.Add(-1)
			refuse(fmt.Errorf("load %q: %w", req.Request, errTooManyLoads))
			return
		}
		if !n.cl.fetches.enter() {
			rec.copyingLoads.Add(-1)
			fail(fmt.Errorf("load %q: %w", req.Request, errClosing)) // the pool is going away
			return
		}
		if !rec.loads.enter() {
			rec.copyingLoads.Add(-1)
			n.cl.fetches.leave()
			fail(fmt.Errorf("%w %q", errUnknownEngine, engineID)) // ending: its segments are going away
			return
		}
		go func() {
			defer n.cl.fetches.leave() // after startLoad: its load actor copies through the transfer actor, which the teardown stops first
			defer rec.loads.leave()
			if f := n.cl.inGate.Load(); f != nil {
				(*f)("remote-load")
			}
			local, pins, fetched, err := n.fetchRemote(ctx, rec, remote, keys)
			rec.copyingLoads.Add(-1)
			if err != nil {
				fail(fmt.Errorf("load %q: %w", req.Request, err))
				return
			}
			if f := n.cl.inGate.Load(); f != nil {
				(*f)("fetched")
			}
			n.startLoad(ctx, span, rec, req, chunks, keys, m.Reply, fetched, local, pins, session, gen, fail)
		}()
		return
	}
	n.startLoad(ctx, span, rec, req, chunks, keys, m.Reply, 0, nil, nil, session, gen, fail)
}

// startLoad pins the keys and hands the copy to a load actor; session and
// gen are the fence's and the engine's silence generations when the load
// was taken; remote is how many chunks its fetch fetched, and localPins
// and fetchPins the pins that fetch took for it (fetchRemote: on the
// load's own chunks in host memory, and the keys it fetched), which it
// lets go of once its own pins hold them or it fails. A key pending in host memory (another copy is
// filling it: a load reading it back from disk, or a store) while every
// other key is
// loadable is waited for off the caller's goroutine, which may be the
// engine's intake worker (waitLoad), and the load tried again once it
// settles. A wait is counted by its outcome and traced on span (ctx's):
// a deferred event, a retry event per try again, a wait_ended event.
func (n *Node) startLoad(ctx context.Context, span trace.Span, rec *engineRec, req ingest.Load,
	chunks []sched.JobChunk, keys []messages.Key, reply string, remote int, localPins *hostpool.Pins, fetchPins []messages.Key,
	session, gen uint64, fail func(error)) {
	ls := &loadStart{ctx: ctx, span: span, rec: rec, req: req, chunks: chunks, keys: keys, reply: reply,
		remote: remote, localPins: localPins, fetchPins: fetchPins, session: session, gen: gen}
	// Every way a load ends without its copy goes through ls.fail: the
	// fetch's pins go with it (refused, aborted, its engine ended, the
	// node closing, a wait for a pending key that ran out).
	ls.fail = func(err error) {
		n.unpinFetch(ls)
		fail(err)
	}
	err := n.tryLoad(ls)
	if !errors.Is(err, hostpool.ErrPending) {
		if err != nil {
			ls.fail(err)
		}
		return
	}
	ls.waitFrom = time.Now()
	if span.IsRecording() {
		span.AddEvent(tracing.EventDeferred, trace.WithAttributes(tracing.AttrReason.String(sched.RetryPending.String())))
	}
	if rec.waitingLoads.Add(1) > maxWaitingLoads {
		rec.waitingLoads.Add(-1)
		n.endWait(ls, waitTooMany)
		ls.fail(err) // as before loads waited: not ready, the key named
		return
	}
	if !n.loadWaits.enter() {
		rec.waitingLoads.Add(-1)
		n.endWait(ls, waitAborted)
		ls.fail(fmt.Errorf("load %q: %w", req.Request, errClosing))
		return
	}
	go n.waitLoad(ls, err)
}

// How a load's wait for a pending key ended (kvactors_load_waits_total's
// outcome label, the wait_ended event's kvactors.outcome).
const (
	waitLoaded   = "loaded"    // a try again pinned its keys: the load went on to its copy
	waitTimedOut = "timed_out" // still pending at Config.LoadWait: failed as a miss
	waitTooMany  = "too_many"  // past maxWaitingLoads: failed at once, not waited
	waitAborted  = "aborted"   // its engine ended or the node closed meanwhile
	waitFailed   = "failed"    // a try again failed otherwise (the key gone, loads in flight past their bound)
)

// loadWaitOutcomes are every outcome (metrics preset them at 0).
var loadWaitOutcomes = []string{waitLoaded, waitTimedOut, waitTooMany, waitAborted, waitFailed}

// endWait counts and traces the end of ls's wait; for waitLoaded it is
// called before the load actor takes the span, which it may end at once.
func (n *Node) endWait(ls *loadStart, outcome string) {
	waited := time.Since(ls.waitFrom)
	n.metrics.LoadWaits.WithLabelValues(outcome).Inc()
	if outcome != waitTooMany { // it did not wait
		n.metrics.LoadWaitTime.Observe(waited.Seconds())
	}
	if ls.span.IsRecording() {
		ls.span.AddEvent(tracing.EventWaitEnded, trace.WithAttributes(tracing.AttrOutcome.String(outcome),
			tracing.AttrWaitMS.Int64(waited.Milliseconds())))
	}
}

// maxCopyingLoads bounds an engine's loads fetching remote chunks, pinned
// and in the copy queue, or copying: past it a load is answered "node
// overloaded" at once, having pinned and fetched nothing. Loads go ahead of stores in the copy queue, and a queued
// load holds pins, not pool room, so without it one engine loading faster
// than the copies run would grow the queue without bound.
const maxCopyingLoads = 256

// errTooManyLoads answers a load past maxCopyingLoads: the node wrote
// nothing, and the engine may try again.
var errTooManyLoads = messages.NewRejection(messages.RejectLimit,
	fmt.Sprintf("%s: more than %d loads of the engine in flight, try again", messages.Overloaded, maxCopyingLoads))

// maxLoadChunks bounds the chunks of an engine's loads in flight, from
// their decode until they end (waiting, fetching, queued or copying): a
// load may name one stored chunk as often as its max_model_len allows, and
// each chunk of its job costs ~150 bytes of heap (its key, its block ids),
// so maxCopyingLoads loads of a 1 MB body (~500,000 chunks each with 64
// groups) would hold ~19 GB, which the intake's byte budget never sees.
// Past it a load is answered "node overloaded" at once, and one load of
// more chunks is refused too_large as its chunks are counted (a body of
// the embedded server's 8 MiB could make ~4M). ~150 MB of heap an engine
// (docs/SECURITY.md, "Bounds"); no load without repeats comes near it
// (its chunks are pinned in the pool: --pool-max-chunks at most).
const maxLoadChunks = 1 << 20

// loadChunksMost is maxLoadChunks, or the node's test bound.
func (n *Node) loadChunksMost() int64 {
	if n.cfg.loadChunksMost > 0 {
		return n.cfg.loadChunksMost
	}
	return maxLoadChunks
}

// errTooManyLoadChunks answers a load that would take the engine's loads in
// flight past most chunks: the node wrote nothing, and the engine may try
// again once its other loads end.
func errTooManyLoadChunks(most int64) error {
	return messages.NewRejection(messages.RejectLimit,
		fmt.Sprintf("%s: the engine's loads in flight would copy more than %d chunks, try again", messages.Overloaded, most))
}

// maxWaitingLoads bounds an engine's loads waiting for pending keys (a
// goroutine and a timer each, for up to Config.LoadWait): past it a load of a
// pending key fails not-ready at once, so one engine cannot park goroutines
// without limit by loading a key its own store holds pending. A waiting
// remote load (on a cluster) keeps its fetch's pins while it waits (its
// chunks stay loadable), so an engine's pins are bounded by
// maxCopyingLoads plus these, each for at most LoadWait.
const maxWaitingLoads = 64

// loadStart is a load taken and checked, until a load actor has its copy.
type loadStart struct {
	ctx          context.Context // carries span
	span         trace.Span      // the load's, ended by fail or the load actor
	rec          *engineRec
	req          ingest.Load
	chunks       []sched.JobChunk
	keys         []messages.Key
	reply        string
	remote       int
	localPins    *hostpool.Pins // its own local chunks, pinned by its fetch until unpinFetch
	fetchPins    []messages.Key // fetched, pinned by its fetch until unpinFetch
	session, gen uint64
	fail         func(error) // lets go of its fetch's pins, then answers the load's failure
	waitFrom     time.Time   // when it first found a key pending (zero: it has not)
}

// unpinFetch lets go of the pins ls's fetch left on the chunks it fetched
// and on the load's local ones, once: after the load's own pins hold them
// (tryLoad), or as it fails. Until then no store evicts one under it.
func (n *Node) unpinFetch(ls *loadStart) {
	if ls.localPins != nil {
		n.store.Unpin(ls.localPins)
		ls.localPins = nil
	}
	if len(ls.fetchPins) > 0 {
		n.store.UnpinRemote(ls.fetchPins)
		ls.fetchPins = nil
	}
}

// tryLoad pins the load's keys (or gives room to those to read back from
// disk) and spawns its load actor, which answers it. On an error nothing
// is pinned and nothing answered.
func (n *Node) tryLoad(ls *loadStart) error {
	rec, req := ls.rec, ls.req
	if rec.copyingLoads.Add(1) > maxCopyingLoads {
		rec.copyingLoads.Add(-1)
		n.metrics.Rejected.WithLabelValues(messages.RejectLimit).Inc()
		return fmt.Errorf("load %q: %w", req.Request, errTooManyLoads)
	}
	if !rec.loads.enter() {
		rec.copyingLoads.Add(-1)
		return fmt.Errorf("load %q: %w %q", req.Request, errUnknownEngine, rec.id) // ending: see loadGate
	}
	evicted, err := rec.store.PrepareLoad(ls.keys) // its evictions are journaled (kvJournal)
	n.metrics.Evictions.Add(float64(len(evicted)))
	if err != nil {
		rec.copyingLoads.Add(-1)
		rec.loads.leave()
		return fmt.Errorf("load %q: %w", req.Request, err)
	}
	n.unpinFetch(ls) // the load's own pins hold its fetched and local chunks now
	done := func() {
		rec.copyingLoads.Add(-1)
		rec.loadChunks.Add(-int64(len(ls.chunks))) // as onLoad counted them; its end is never called now
		rec.loads.leave()
	}
	if !ls.waitFrom.IsZero() {
		n.endWait(ls, waitLoaded)
	}
	n.system.Root.Spawn(load.Props(load.Deps{Transfer: n.transfer, Queue: n.copyQueue, Outbox: n.outbox,
		Metrics: n.metrics.Load, Unexpected: n.metrics.Unexpected.WithLabelValues(actors.KindLoad), Tracer: n.tracer, Log: n.log, Reject: n.rejectLog, Node: n.cfg.NodeID, Boot: n.boot,
		Done: done},
		&load.Job{Engine: rec.id, Request: req.Request, Tokens: req.NumTokens, Store: rec.store, Chunks: ls.chunks,
			Bytes: store.CopyBytes(rec.layout, ls.chunks), Reply: ls.reply, Ctx: ls.ctx, Span: ls.span, RemoteChunks: ls.remote, Session: ls.session, Hearing: rec.hearing, HearingGen: ls.gen}))
	return nil
}

// waitLoad waits for the key that err (hostpool.ErrPending) names to
// settle, woken by the copy filling it as it ends (Engine.WaitPending),
// and tries the load again, until it starts or fails otherwise: two loads
// of one prefix read back from disk at once both succeed, and a lookup's
// hit on a chunk being read back holds. It waits Config.LoadWait at most
// (a read back or a store waits in the copy queue and copies well within
// that; past it, the engine's request would time out and leave the load in
// doubt), then fails the load as a miss naming the key; it fails it at once if the
// engine ends or the node closes meanwhile. Its own goroutine, counted in
// loadWaits.
func (n *Node) waitLoad(ls *loadStart, err error) {
	defer n.loadWaits.leave()
	defer ls.rec.waitingLoads.Add(-1)
	timeout := time.NewTimer(n.cfg.LoadWait)
	defer timeout.Stop()
	settled := hostpool.NewSignal() // for each key in turn: a spare wake-up only makes it try again early
	attempt := 0
	retry := func() error {
		attempt++
		n.metrics.LoadRetries.Inc()
		if ls.span.IsRecording() {
			ls.span.AddEvent(tracing.EventRetry, trace.WithAttributes(
				tracing.AttrReason.String(sched.RetryPending.String()), tracing.AttrAttempt.Int(attempt)))
		}
		return n.tryLoad(ls) // on success it ended the wait (waitLoaded)
	}
	for errors.Is(err, hostpool.ErrPending) {
		var ke *hostpool.KeyError
		if !errors.As(err, &ke) {
			break // not one key to wait for (a bug): fail as a miss
		}
		ls.rec.store.WaitPending([]messages.Key{ke.Key}, settled)
		select {
		case <-settled:
		case <-timeout.C:
			if err = retry(); err != nil { // a last try; still pending: a miss
				outcome := waitFailed
				if errors.Is(err, hostpool.ErrPending) {
					outcome = waitTimedOut
				}
				n.endWait(ls, outcome)
				ls.fail(err)
			}
			return
		case <-ls.rec.closed:
			n.endWait(ls, waitAborted)
			ls.fail(fmt.Errorf("load %q: %w %q", ls.req.Request, errUnknownEngine, ls.rec.id))
			return
		case <-n.loadWaitStop:
			n.endWait(ls, waitAborted)
			ls.fail(fmt.Errorf("load %q: %w", ls.req.Request, errClosing))
			return
		}
		err = retry()
	}
	if err != nil {
		n.endWait(ls, waitFailed)
		ls.fail(err)
	}
}

// diskChanged announces the disk tier's writes and deletions (medium DISK)
// for the engine that spilled the chunks (each key on an engine of its own
// namespace, see kvTarget), through the journal. The disk speaks in disk
// keys: a key whose namespace is not open in this boot is not announced.
func (n *Node) diskChanged(engineID string, stored, removed []messages.Key) {
	poolKeys := func(keys []messages.Key) []messages.Key {
		out := keys[:0:0]
		for _, k := range keys {
			if pk, ok := n.diskKeys.FromDisk(k); ok {
				out = append(out, pk)
			}
		}
		return out
	}
	// Through the journal: after the BlockRemoved CPU of the eviction
	// that spilled them, which the pool journaled before the spill.
	n.kv.add(engineID, messages.KVBlockStored, messages.MediumDisk, poolKeys(stored))
	n.kv.add(engineID, messages.KVBlockRemoved, messages.MediumDisk, poolKeys(removed))
}
