package actors

import (
	"context"
	"encoding/json"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/tracing"
	"github.com/kvactors/kvactors/wire"
)

// Subject verbs of protocol v1.
const (
	VerbRegister = "register"
	VerbEvents   = "events"
	VerbReleased = "released"
	VerbStored   = "stored"
	VerbKVEvents = "kv_events"
	VerbLookup   = "lookup"
	VerbLoad     = "load"
	VerbStatus   = "status"
)

// Outbox publishes kvactors' messages to engines and routers. Publishing on a
// core NATS connection is a buffered write, so actors may call it from
// Receive. Each message carries the caller's trace context in its headers.
type Outbox struct {
	nc     *nats.Conn
	prefix string
	log    *slog.Logger
	now    func() time.Time
}

// NewOutbox publishes on nc under prefix.
func NewOutbox(nc *nats.Conn, prefix string, log *slog.Logger) *Outbox {
	return &Outbox{nc: nc, prefix: prefix, log: log, now: time.Now}
}

// Subject is P.E.verb.
func (o *Outbox) Subject(engine, verb string) string { return o.prefix + "." + engine + "." + verb }

// Released publishes P.E.released.
func (o *Outbox) Released(ctx context.Context, engine, request, reason string) {
	o.send(ctx, o.Subject(engine, VerbReleased),
		wire.AppendReleased(nil, &messages.Released{Request: request, Reason: reason}))
}

// Stored publishes P.E.stored for one completed store job.
func (o *Outbox) Stored(ctx context.Context, engine string, s *messages.Stored) {
	o.send(ctx, o.Subject(engine, VerbStored), wire.AppendStored(make([]byte, 0, 64+80*len(s.Chunks)), s))
}

// KVEvents publishes one P.E.kv_events batch (nothing when events is empty).
func (o *Outbox) KVEvents(ctx context.Context, engine string, events []messages.KVEvent) {
	if len(events) == 0 {
		return
	}
	ts := float64(o.now().UnixNano()) / 1e9
	o.send(ctx, o.Subject(engine, VerbKVEvents), wire.AppendKVEvents(nil, &messages.KVEventBatch{TS: ts, Events: events}))
}

// Reply answers a request/reply message (no-op without a reply subject).
func (o *Outbox) Reply(ctx context.Context, reply string, v any) {
	if reply != "" {
		o.publish(ctx, reply, v)
	}
}

func (o *Outbox) publish(ctx context.Context, subject string, v any) {
	data, err := json.Marshal(v)
	if err != nil { // our own types: a bug, not bad input
		o.log.Error("encode outgoing message", "subject", subject, "err", err)
		return
	}
	o.send(ctx, subject, data)
}

func (o *Outbox) send(ctx context.Context, subject string, data []byte) {
	msg := &nats.Msg{Subject: subject, Data: data}
	if trace.SpanContextFromContext(ctx).IsValid() {
		msg.Header = nats.Header{}
		tracing.Inject(ctx, msg.Header)
	}
	if err := o.nc.PublishMsg(msg); err != nil {
		o.log.Error("publish", "subject", subject, "err", err)
	}
}
