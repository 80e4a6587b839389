package node

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"slices"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/trace"

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
	hit := rec.layout.HitTokens(hashes, n.store.Ready)
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
		level := slog.LevelError
		if errors.Is(err, hostpool.ErrNotReady) {
			level = slog.LevelInfo // evicted or never stored: a miss, not bad input
		}
		n.log.Log(ctx, level, "load refused", "engine", engineID, "err", err)
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
	evicted, err := rec.store.PrepareLoad(keys)
	n.evicted(ctx, engineID, evicted) // room for chunks read back from disk
	if err != nil {
		fail(fmt.Errorf("load %q: %w", req.Request, err))
		return
	}
	rec.loads.Add(1)
	n.system.Root.Spawn(load.Props(load.Deps{Transfer: n.transfer, Outbox: n.outbox,
		Metrics: n.metrics, Tracer: n.tracer, Log: n.log, Node: n.cfg.NodeID, Boot: n.boot, Done: rec.loads.Done,
		Removed: func(ctx context.Context, engine string, keys []messages.Key) {
			n.announce(ctx, engine, messages.KVBlockRemoved, messages.MediumCPU, keys)
		}},
		&load.Job{Engine: engineID, Request: req.Request, Tokens: req.NumTokens, Store: rec.store, Chunks: chunks,
			Bytes: store.CopyBytes(rec.layout, chunks), Reply: m.Reply, Ctx: ctx}))
}

// evicted announces keys evicted from host memory outside a store decision
// (a load making room to read chunks back from disk): BlockRemoved, medium
// CPU, one event per group.
func (n *Node) evicted(ctx context.Context, engineID string, keys []messages.Key) {
	if len(keys) == 0 {
		return
	}
	n.metrics.Evictions.Add(float64(len(keys)))
	n.announce(ctx, engineID, messages.KVBlockRemoved, messages.MediumCPU, keys)
}

// diskChanged announces the disk tier's writes and deletions (medium DISK)
// on the engine that spilled the chunks.
func (n *Node) diskChanged(engineID string, stored, removed []messages.Key) {
	if n.outbox == nil {
		return
	}
	ctx := context.Background()
	n.announce(ctx, engineID, messages.KVBlockStored, messages.MediumDisk, stored)
	n.announce(ctx, engineID, messages.KVBlockRemoved, messages.MediumDisk, removed)
}

// announce publishes keys the store or the disk tier added or dropped
// outside a request's own store job (load-made room, corrupt chunks, disk
// writes and deletions) on engineID's kv_events: the one place that turns
// such keys into kv_events (with namespaces, the place to route a key to an
// engine of its own namespace, as request evictions are).
func (n *Node) announce(ctx context.Context, engineID, typ, medium string, keys []messages.Key) {
	if len(keys) == 0 {
		return
	}
	n.outbox.KVEvents(ctx, engineID, kvEvents(typ, medium, keys))
}

// kvEvents groups keys into one event per group, block hashes in hex.
func kvEvents(typ, medium string, keys []messages.Key) []messages.KVEvent {
	var out []messages.KVEvent
	for _, k := range keys {
		hash, g := sched.SplitKey(k)
		i := slices.IndexFunc(out, func(e messages.KVEvent) bool { return e.GroupIdx == g })
		if i < 0 {
			i = len(out)
			out = append(out, messages.KVEvent{Type: typ, GroupIdx: g, Medium: medium})
		}
		out[i].BlockHashes = append(out[i].BlockHashes, hex.EncodeToString([]byte(hash)))
	}
	return out
}
