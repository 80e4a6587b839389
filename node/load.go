package node

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"github.com/nats-io/nats.go"
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

// onLookup answers P.E.lookup: the hit tokens of a hash prefix.
func (n *Node) onLookup(engineID string, m *nats.Msg) {
	ctx := n.msgCtx(m)
	n.metrics.Lookups.Inc()
	var err error
	rec := n.engine(engineID)
	if rec == nil {
		err = fmt.Errorf("%w %q", errUnknownEngine, engineID)
	}
	var hashes []messages.Hash
	if err == nil {
		hashes, err = ingest.DecodeLookup(m.Data, n.cfg.Limits)
	}
	if err != nil {
		n.rejected(messages.RejectLabel(err), "lookup refused", "subject", m.Subject, "err", err)
		n.outbox.Reply(ctx, m.Reply, messages.LookupReply{Error: err.Error(), Node: n.cfg.NodeID, Boot: n.boot})
		return
	}
	_, span := n.tracer.Start(ctx, tracing.SpanLookup, trace.WithAttributes(tracing.AttrEngine.String(engineID)))
	defer span.End()
	ns := rec.clusterNamespace()
	hit := rec.layout.HitTokens(hashes, func(k messages.Key) bool {
		return n.store.Ready(k) || n.heldElsewhere(ns, k)
	})
	span.SetAttributes(tracing.AttrHashes.Int(len(hashes)), tracing.AttrHitTokens.Int(hit))
	if hit > 0 {
		n.metrics.LookupHits.Inc()
		n.metrics.HitTokens.Add(float64(hit))
	}
	n.outbox.Reply(ctx, m.Reply, messages.LookupReply{HitTokens: hit, Node: n.cfg.NodeID, Boot: n.boot})
}

// onLoad starts P.E.load: the keys are pinned here, then a load actor runs
// the copy and answers once it completed.
// errLoadAfterSilence refuses a load between an engine's silence of lease/2
// and its next epoch.
var errLoadAfterSilence = errors.New("engine was silent for lease/2 or more: no load until it begins a new epoch (resync)")

func (n *Node) onLoad(engineID string, m *nats.Msg, session uint64) {
	ctx := n.msgCtx(m)
	fail := func(err error) {
		n.metrics.Loads.WithLabelValues(load.ResultError).Inc()
		level, reason := slog.LevelError, "load_error"
		if errors.Is(err, hostpool.ErrNotReady) {
			level, reason = slog.LevelInfo, "load_miss" // evicted or never stored: a miss, not bad input
		}
		// Rate-limited: an engine chooses how many loads fail (docs/SECURITY.md).
		n.rejectLog.Log(level, reason, "load refused", "engine", engineID, "err", err)
		n.outbox.Reply(ctx, m.Reply, messages.LoadReply{Error: err.Error(), Node: n.cfg.NodeID, Boot: n.boot})
	}
	rec := n.engine(engineID)
	if rec == nil {
		fail(fmt.Errorf("%w %q", errUnknownEngine, engineID))
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
		fail(err)
		return
	}
	chunks, err := rec.layout.LoadChunks(req.Hashes, req.NumTokens, req.Blocks)
	if err != nil {
		fail(err)
		return
	}
	keys := make([]messages.Key, len(chunks))
	for i := range chunks {
		keys[i] = chunks[i].Key
	}
	if remote := n.remoteKeys(rec, keys); len(remote) > 0 {
		// Fetching takes round trips: off the ingest worker, holding the
		// device open as a load does.
		if !n.cl.fetches.enter() {
			fail(fmt.Errorf("load %q: %w", req.Request, errClosing)) // the pool is going away
			return
		}
		if !rec.loads.enter() {
			n.cl.fetches.leave()
			fail(fmt.Errorf("%w %q", errUnknownEngine, engineID)) // ending: its segments are going away
			return
		}
		go func() {
			defer n.cl.fetches.leave() // after startLoad: its load actor copies through the transfer actor, which the teardown stops first
			defer rec.loads.leave()
			fetched, err := n.fetchRemote(ctx, rec, remote)
			if err != nil {
				fail(fmt.Errorf("load %q: %w", req.Request, err))
				return
			}
			n.startLoad(ctx, rec, req, chunks, keys, m.Reply, fetched, session, gen, fail)
		}()
		return
	}
	n.startLoad(ctx, rec, req, chunks, keys, m.Reply, 0, session, gen, fail)
}

// startLoad pins the keys and hands the copy to a load actor; session and
// gen are the fence's and the engine's silence generations when the load
// was taken.
func (n *Node) startLoad(ctx context.Context, rec *engineRec, req ingest.Load, chunks []sched.JobChunk,
	keys []messages.Key, reply string, remote int, session, gen uint64, fail func(error)) {
	if !rec.loads.enter() {
		fail(fmt.Errorf("load %q: %w %q", req.Request, errUnknownEngine, rec.id)) // ending: see loadGate
		return
	}
	evicted, err := rec.store.PrepareLoad(keys) // its evictions are journaled (kvJournal)
	n.metrics.Evictions.Add(float64(len(evicted)))
	if err != nil {
		rec.loads.leave()
		fail(fmt.Errorf("load %q: %w", req.Request, err))
		return
	}
	n.system.Root.Spawn(load.Props(load.Deps{Transfer: n.transfer, Outbox: n.outbox,
		Metrics: n.metrics.Load, Unexpected: n.metrics.Unexpected.WithLabelValues(actors.KindLoad), Tracer: n.tracer, Log: n.log, Node: n.cfg.NodeID, Boot: n.boot, Done: rec.loads.leave},
		&load.Job{Engine: rec.id, Request: req.Request, Tokens: req.NumTokens, Store: rec.store, Chunks: chunks,
			Bytes: store.CopyBytes(rec.layout, chunks), Reply: reply, Ctx: ctx, RemoteChunks: remote, Session: session, Hearing: rec.hearing, HearingGen: gen}))
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
