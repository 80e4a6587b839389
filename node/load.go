package node

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvactors/kvactors/actors/load"
	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/ingest"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
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
	pool := n.sharedPool()
	ns := n.engineNamespace(engineID)
	hit := rec.layout.HitTokens(hashes, func(k messages.Key) bool {
		st, _ := pool.Lookup(k)
		return st == hostpool.Ready || n.heldElsewhere(ns, k)
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
func (n *Node) onLoad(engineID string, m *nats.Msg) {
	ctx := n.msgCtx(m)
	fail := func(err error) {
		n.metrics.Loads.WithLabelValues("error").Inc()
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
	if remote := n.remoteKeys(engineID, keys); len(remote) > 0 {
		// Fetching takes round trips: off the ingest worker, holding the
		// device open as a load does.
		rec.loads.Add(1)
		go func() {
			defer rec.loads.Done()
			fetched, err := n.fetchRemote(ctx, engineID, remote)
			if err != nil {
				fail(fmt.Errorf("load %q: %w", req.Request, err))
				return
			}
			n.startLoad(ctx, rec, req, chunks, keys, m.Reply, fetched, fail)
		}()
		return
	}
	n.startLoad(ctx, rec, req, chunks, keys, m.Reply, 0, fail)
}

// startLoad pins the keys and hands the copy to a load actor.
func (n *Node) startLoad(ctx context.Context, rec *engineRec, req ingest.Load, chunks []sched.JobChunk,
	keys []messages.Key, reply string, remote int, fail func(error)) {
	pool := n.sharedPool()
	slots, err := pool.PrepareLoad(keys)
	if err != nil {
		fail(fmt.Errorf("load %q: %w", req.Request, err))
		return
	}
	var bytes int64
	for i := range chunks {
		chunks[i].Slot = slots[i]
		bytes += rec.layout.CopyBytes(&chunks[i])
	}
	rec.loads.Add(1)
	n.system.Root.Spawn(load.Props(load.Deps{Pool: pool, Transfer: n.transfer, Outbox: n.outbox,
		Metrics: n.metrics, Tracer: n.tracer, Log: n.log, Node: n.cfg.NodeID, Boot: n.boot, Done: rec.loads.Done},
		&load.Job{Engine: rec.id, Request: req.Request, Tokens: req.NumTokens, Keys: keys, Chunks: chunks,
			Bytes: bytes, Layout: rec.layout, Device: rec.device, SlotBytes: n.slotBytesNow(), Reply: reply, Ctx: ctx,
			RemoteChunks: remote}))
}

func (n *Node) sharedPool() *hostpool.Shared {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.pool
}

func (n *Node) slotBytesNow() int64 {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.slotBytes
}
