package actors

import (
	"context"
	"encoding/json"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/tracing"
	"github.com/kvactors/kvactors/wire"
)

// Outbox publishes kvactors' messages to engines and routers. Publishing on a
// core NATS connection is a buffered write, so actors may call it from
// Receive. Each message carries the caller's trace context in its headers.
type Outbox struct {
	nc     *nats.Conn
	prefix string
	log    *slog.Logger
	now    func() time.Time

	// sealMu orders every publish against Seal: after Seal nothing more is
	// published, so what a shutdown reports as undelivered stays so.
	sealMu   sync.RWMutex
	sealed   bool
	releases atomic.Int64 // releases published
}

// NewOutbox publishes on nc under prefix.
func NewOutbox(nc *nats.Conn, prefix string, log *slog.Logger) *Outbox {
	return &Outbox{nc: nc, prefix: prefix, log: log, now: time.Now}
}

// Subject is P.E.verb.
func (o *Outbox) Subject(engine, verb string) string {
	return messages.EngineSubject(o.prefix, engine, verb)
}

// releasedLocked publishes P.E.released; only Releases calls it (holding
// sealMu for reading), so that every release is numbered.
func (o *Outbox) releasedLocked(ctx context.Context, engine string, r *messages.Released) {
	o.releases.Add(1)
	o.sendLocked(ctx, o.Subject(engine, messages.VerbReleased), wire.AppendReleased(nil, r))
}

// Seal stops all publishing and returns count(), read while no publish is
// in progress.
func (o *Outbox) Seal(count func() int64) int64 {
	o.sealMu.Lock()
	defer o.sealMu.Unlock()
	o.sealed = true
	return count()
}

// Releases is how many releases have been published.
func (o *Outbox) Releases() int64 { return o.releases.Load() }

// Resync publishes P.E.resync.
func (o *Outbox) Resync(ctx context.Context, engine string, r *messages.Resync) {
	o.publish(ctx, o.Subject(engine, messages.VerbResync), r)
}

// Node publishes on P._node.<node>.<verb> (hello, heartbeat).
func (o *Outbox) Node(node, verb string, v any) {
	o.publish(context.Background(), messages.NodeSubject(o.prefix, node, verb), v)
}

// Stored publishes P.E.stored for one completed store job.
func (o *Outbox) Stored(ctx context.Context, engine string, s *messages.Stored) {
	o.send(ctx, o.Subject(engine, messages.VerbStored), wire.AppendStored(make([]byte, 0, 64+80*len(s.Chunks)), s))
}

// KVEvents publishes one P.E.kv_events batch (nothing when events is empty).
func (o *Outbox) KVEvents(ctx context.Context, engine string, events []messages.KVEvent) {
	if len(events) == 0 {
		return
	}
	ts := float64(o.now().UnixNano()) / 1e9
	o.send(ctx, o.Subject(engine, messages.VerbKVEvents), wire.AppendKVEvents(nil, &messages.KVEventBatch{TS: ts, Events: events}))
}

// AllBlocksCleared publishes P.E.kv_events {"ts","events":[{"type":
// "AllBlocksCleared","medium":"CPU"}]}: routers drop what they believed this
// node held for the engine.
func (o *Outbox) AllBlocksCleared(ctx context.Context, engine string) {
	type cleared struct {
		Type   string `json:"type"`
		Medium string `json:"medium"`
	}
	o.publish(ctx, o.Subject(engine, messages.VerbKVEvents), struct {
		TS     float64   `json:"ts"`
		Events []cleared `json:"events"`
	}{float64(o.now().UnixNano()) / 1e9, []cleared{{messages.KVAllBlocksCleared, messages.MediumCPU}}})
}

// Reply answers a request/reply message (no-op without a reply subject).
func (o *Outbox) Reply(ctx context.Context, reply string, v any) {
	if reply != "" {
		o.publish(ctx, reply, v)
	}
}

func (o *Outbox) publish(ctx context.Context, subject string, v any) {
	o.sealMu.RLock()
	defer o.sealMu.RUnlock()
	o.publishLocked(ctx, subject, v)
}

func (o *Outbox) publishLocked(ctx context.Context, subject string, v any) {
	data, err := json.Marshal(v)
	if err != nil { // our own types: a bug, not bad input
		o.log.Error("encode outgoing message", "subject", subject, "err", err)
		return
	}
	o.sendLocked(ctx, subject, data)
}

func (o *Outbox) send(ctx context.Context, subject string, data []byte) {
	o.sealMu.RLock()
	defer o.sealMu.RUnlock()
	o.sendLocked(ctx, subject, data)
}

func (o *Outbox) sendLocked(ctx context.Context, subject string, data []byte) {
	if o.sealed {
		return // shutting down: the caller reports what was not sent
	}
	msg := &nats.Msg{Subject: subject, Data: data}
	if trace.SpanContextFromContext(ctx).IsValid() {
		msg.Header = nats.Header{}
		tracing.Inject(ctx, msg.Header)
	}
	if err := o.nc.PublishMsg(msg); err != nil {
		o.log.Error("publish", "subject", subject, "err", err)
	}
}
