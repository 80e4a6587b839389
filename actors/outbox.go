package actors

import (
	"context"
	"encoding/json"
	"log/slog"
	"maps"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/ratelog"
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

	stamp *KVStamp
	kvHdr nats.Header // node and boot of the stamp (nil without one)

	// subjects caches each engine's P.E.verb for the verbs published per
	// request or per job (building one was a tenth of the node's
	// allocations, by count); nsubjects bounds it (cleared when full, since
	// engine ids come and go).
	subjects  sync.Map // engine → *engineSubjects
	nsubjects atomic.Int64

	// refused counts the replies refused by the reply rule (replyOK);
	// onRefused, when set, is told of each (the node counts and logs it).
	refused   atomic.Int64
	onRefused func(reply string)

	// failed counts the messages the NATS client refused (or that could
	// not be encoded): each is lost, not retried. onFailed, when set, is
	// told the kind of each (the node counts it); failLog logs them, rate
	// limited per kind as refused input is.
	failed   atomic.Int64
	onFailed func(kind string)
	failLog  *ratelog.Log

	// bodyMax is BodyMax, read from the server's INFO at NewOutbox and at
	// each reconnect (Refresh): nats.go takes its connection's lock to
	// read it, which every publish contends for.
	bodyMax atomic.Int64
}

// BodyMax is the largest body one message may carry on the server the
// connection is on: what a body cut into several messages is cut at
// (kv_events, a large job's stored). 0: no connection yet.
func (o *Outbox) BodyMax() int { return int(o.bodyMax.Load()) }

// Refresh reads the server's max_payload again: call it on a reconnect,
// which may have reached a server configured otherwise.
func (o *Outbox) Refresh() {
	if o.nc == nil {
		return
	}
	mp := o.nc.MaxPayload()
	o.bodyMax.Store(max(mp-messages.HeaderRoom, mp/2))
}

// The kinds of message the outbox publishes, besides the verbs released,
// stored, kv_events and resync: every reply, and the node's own hello and
// heartbeat. They label kvactors_nats_publish_failures_total.
const (
	PublishReply = "reply"
	PublishNode  = "node"
)

// PublishKinds lists every kind (metrics preset the label at 0).
var PublishKinds = []string{messages.VerbReleased, messages.VerbStored, messages.VerbKVEvents, messages.VerbResync,
	PublishReply, PublishNode}

// hotVerbs are the verbs Subject caches, in engineSubjects' order.
var hotVerbs = [...]string{messages.VerbReleased, messages.VerbStored, messages.VerbKVEvents}

type engineSubjects [len(hotVerbs)]string

// maxCachedEngines bounds Outbox.subjects.
const maxCachedEngines = 4096

// KVStamp is what a clustered node adds to its kv_events (docs/CLUSTER.md):
// the Kvactors-Node and Kvactors-Boot headers, so other nodes know whose
// pool a batch describes.
type KVStamp struct {
	Node, Boot string
}

// SetKVStamp stamps every later kv_events batch; call it before anything is
// published.
func (o *Outbox) SetKVStamp(s *KVStamp) {
	o.stamp = s
	o.kvHdr = nats.Header{messages.HeaderNode: []string{s.Node}, messages.HeaderBoot: []string{s.Boot}}
}

// kvHeader is the stamp's header, built once; sendLocked clones it before
// adding a trace context, so the shared map is never written.
func (o *Outbox) kvHeader() nats.Header { return o.kvHdr }

// NewOutbox publishes on nc under prefix.
func NewOutbox(nc *nats.Conn, prefix string, log *slog.Logger) *Outbox {
	o := &Outbox{nc: nc, prefix: prefix, log: log, now: time.Now, failLog: ratelog.NewLog(log, nil)}
	o.Refresh()
	return o
}

// Subject is P.E.verb.
func (o *Outbox) Subject(engine, verb string) string {
	i := 0
	for i < len(hotVerbs) && hotVerbs[i] != verb {
		i++
	}
	if i == len(hotVerbs) {
		return messages.EngineSubject(o.prefix, engine, verb)
	}
	if v, ok := o.subjects.Load(engine); ok {
		return v.(*engineSubjects)[i]
	}
	if o.nsubjects.Add(1) > maxCachedEngines {
		o.subjects.Clear()
		o.nsubjects.Store(1)
	}
	var subj engineSubjects
	for k, vb := range hotVerbs {
		subj[k] = messages.EngineSubject(o.prefix, engine, vb)
	}
	v, _ := o.subjects.LoadOrStore(engine, &subj)
	return v.(*engineSubjects)[i]
}

// bodies recycles the buffers of the hand-encoded bodies (released, stored,
// kv_events): nats.go copies a published body into its write buffer, so
// the buffer is free again once PublishMsg returns.
var bodies = sync.Pool{New: func() any { return new([]byte) }}

// maxPooledBody: a larger buffer (a big eviction batch) is left to the GC.
const maxPooledBody = 64 << 10

func getBody() *[]byte { return bodies.Get().(*[]byte) }

func putBody(b *[]byte, data []byte) {
	if cap(data) <= maxPooledBody {
		*b = data[:0]
		bodies.Put(b)
	}
}

// releasedLocked publishes P.E.released; only Releases calls it (holding
// sealMu for reading), so that every release is numbered.
func (o *Outbox) releasedLocked(ctx context.Context, engine string, r *messages.Released) {
	o.releases.Add(1)
	b := getBody()
	data := wire.AppendReleased(*b, r)
	o.sendLocked(ctx, messages.VerbReleased, o.Subject(engine, messages.VerbReleased), data, nil)
	putBody(b, data)
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
	o.publish(ctx, messages.VerbResync, o.Subject(engine, messages.VerbResync), r)
}

// Node publishes on P._node.<node>.<verb> (hello, heartbeat), and reports
// whether it was handed to NATS (not when sealed, or refused).
func (o *Outbox) Node(node, verb string, v any) bool {
	return o.publish(context.Background(), PublishNode, messages.NodeSubject(o.prefix, node, verb), v)
}

// Stored publishes P.E.stored for one completed store job: build appends
// the body (wire.AppendStoredOpen and the rest) to a pooled buffer.
func (o *Outbox) Stored(ctx context.Context, engine string, build func(body []byte) []byte) {
	b := getBody()
	data := build(*b)
	o.sendHeader(ctx, messages.VerbStored, o.Subject(engine, messages.VerbStored), data, nil)
	putBody(b, data)
}

// KVEventsBody publishes one P.E.kv_events body, encoded by the caller
// (the node's journal writes it in place; wire.AppendKVBatchOpen and the
// rest). On a cluster (SetKVStamp) it carries messages.HeaderGeometry: geometry is
// the fingerprint of the geometry of the namespaces of every key it names.
func (o *Outbox) KVEventsBody(ctx context.Context, engine string, geometry uint64, body []byte) {
	h := o.kvHeader()
	if h != nil {
		h = maps.Clone(h)
		h.Set(messages.HeaderGeometry, messages.GeometryHex(geometry))
	}
	o.sendHeader(ctx, messages.VerbKVEvents, o.Subject(engine, messages.VerbKVEvents), body, h)
}

// AllBlocksCleared publishes P.E.kv_events {"ts","events":[{"type":
// "AllBlocksCleared","medium":"CPU"}]}: routers drop what they believed this
// node held for the engine.
func (o *Outbox) AllBlocksCleared(ctx context.Context, engine string) {
	type cleared struct {
		Type   string `json:"type"`
		Medium string `json:"medium"`
	}
	data, _ := json.Marshal(struct { // plain strings and a float: cannot fail
		TS     float64   `json:"ts"`
		Events []cleared `json:"events"`
	}{float64(o.now().UnixNano()) / 1e9, []cleared{{messages.KVAllBlocksCleared, messages.MediumCPU}}})
	o.sendHeader(ctx, messages.VerbKVEvents, o.Subject(engine, messages.VerbKVEvents), data, o.kvHeader())
}

// OnRefusedReply has f told of every reply the reply rule refuses, after it
// is counted; call it before anything is published.
func (o *Outbox) OnRefusedReply(f func(reply string)) { o.onRefused = f }

// RefusedReplies is how many replies the reply rule refused.
func (o *Outbox) RefusedReplies() int64 { return o.refused.Load() }

// Reply answers a request/reply message (no-op without a reply subject).
// It and Releases.Reply are the only ways the node answers an engine's or a
// router's message, and both publish only where replyOK allows. (The
// node-to-node servers, cluster fetch and keys, answer with m.Respond: only
// kvactors' own user may publish on P._node.>, under the generated
// permissions.)
func (o *Outbox) Reply(ctx context.Context, reply string, v any) {
	if o.replyOK(reply) {
		o.publish(ctx, PublishReply, reply, v)
	}
}

// replyOK is the reply rule (PROTOCOL.md "kvactors' choice, replies"),
// enforced here for every reply whatever path it took: false without a
// reply subject, and false, counted and reported to onRefused, for one
// that is not a reply inbox (messages.ReplyAllowed). The node publishes
// with its own permissions (every engine's subjects, its JetStream API),
// so an answer on a subject the sender picked would publish there for it.
func (o *Outbox) replyOK(reply string) bool {
	if reply == "" {
		return false
	}
	if messages.ReplyAllowed(reply) {
		return true
	}
	o.refused.Add(1)
	if o.onRefused != nil {
		o.onRefused(reply)
	}
	return false
}

// OnPublishFailed has f told the kind (PublishKinds) of every message lost
// to a publish error, after it is counted; call it before anything is
// published.
func (o *Outbox) OnPublishFailed(f func(kind string)) { o.onFailed = f }

// PublishFailures is how many messages were lost to publish errors.
func (o *Outbox) PublishFailures() int64 { return o.failed.Load() }

// FlushLog writes the summary line of each kind of publish failure whose
// log window is over with failures unlogged (call it periodically, as
// ratelog.Log.Flush).
func (o *Outbox) FlushLog() { o.failLog.Flush() }

func (o *Outbox) publish(ctx context.Context, kind, subject string, v any) bool {
	o.sealMu.RLock()
	defer o.sealMu.RUnlock()
	return o.publishLocked(ctx, kind, subject, v)
}

func (o *Outbox) publishLocked(ctx context.Context, kind, subject string, v any) bool {
	data, err := json.Marshal(v)
	if err != nil { // our own types: a bug, not bad input
		o.lost(kind, "encode outgoing message: message lost", subject, err)
		return false
	}
	return o.sendLocked(ctx, kind, subject, data, nil)
}

func (o *Outbox) sendHeader(ctx context.Context, kind, subject string, data []byte, h nats.Header) {
	o.sealMu.RLock()
	defer o.sealMu.RUnlock()
	o.sendLocked(ctx, kind, subject, data, h)
}

// lost counts and logs one message that did not go out. Nothing retries
// it: what each kind's loss costs, and what recovers it, is in
// docs/OBSERVABILITY.md (kvactors_nats_publish_failures_total).
func (o *Outbox) lost(kind, msg, subject string, err error) {
	o.failed.Add(1)
	if o.onFailed != nil {
		o.onFailed(kind)
	}
	// Per kind, so an outage's flood of failures costs a few lines a
	// minute (the kinds are our constants: the limiter's keys stay bounded).
	o.failLog.Reject("publish_"+kind, msg, "subject", subject, "err", err)
}

func (o *Outbox) sendLocked(ctx context.Context, kind, subject string, data []byte, h nats.Header) bool {
	if o.sealed {
		return false // shutting down: the caller reports what was not sent
	}
	msg := &nats.Msg{Subject: subject, Data: data, Header: h}
	if trace.SpanContextFromContext(ctx).IsValid() {
		if msg.Header == nil {
			msg.Header = nats.Header{}
		} else {
			msg.Header = maps.Clone(msg.Header) // callers' headers may be shared (kvHeader)
		}
		tracing.Inject(ctx, msg.Header)
	}
	if err := o.nc.PublishMsg(msg); err != nil {
		o.lost(kind, "publish failed: message lost", subject, err)
		return false
	}
	return true
}
