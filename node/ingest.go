package node

import (
	"context"
	"errors"
	"hash/fnv"
	"sync"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/ingest"
	"github.com/kvactors/kvactors/tracing"
)

// ingester serialises each engine's inbound messages. Every protocol subject
// is a channel subscription into one channel, which nats.go fills from its
// read loop in arrival order; a dispatcher shards messages by engine id onto
// a few workers (llm-d's sharded queues), so one engine's register, events,
// status, lookup and load are handled in the order the engine sent them,
// while different engines decode in parallel.
type ingester struct {
	n       *Node
	in      chan *nats.Msg
	queues  []chan inbound
	wg      sync.WaitGroup
	mu      sync.RWMutex
	engines map[string]*actor.PID
}

// Buffer sizes: the inbound channel absorbs bursts (past it NATS counts the
// subscription a slow consumer and drops, as for any NATS subscriber); the
// shard queues hand off to the workers.
const (
	inboundDepth = 1 << 16
	queueDepth   = 1024
)

// inbound is a message with its subject already parsed by the dispatcher.
type inbound struct {
	msg          *nats.Msg
	engine, verb string
}

func newIngester(n *Node, workers int) *ingester {
	in := &ingester{n: n, in: make(chan *nats.Msg, inboundDepth), engines: map[string]*actor.PID{}}
	for range workers {
		q := make(chan inbound, queueDepth)
		in.queues = append(in.queues, q)
		in.wg.Add(1)
		go in.work(q)
	}
	in.wg.Add(1)
	go in.dispatch()
	return in
}

func (in *ingester) route(engineID string, pid *actor.PID) {
	in.mu.Lock()
	in.engines[engineID] = pid
	in.mu.Unlock()
}

func (in *ingester) lookup(engineID string) *actor.PID {
	in.mu.RLock()
	defer in.mu.RUnlock()
	return in.engines[engineID]
}

// dispatch shards by engine id. It parses only the subject.
func (in *ingester) dispatch() {
	defer in.wg.Done()
	defer func() {
		for _, q := range in.queues {
			close(q)
		}
	}()
	for m := range in.in {
		engineID, verb, err := ingest.ParseSubject(in.n.cfg.Prefix, m.Subject)
		if err != nil {
			in.n.rejected(ingest.Reason(err), "bad subject", "subject", m.Subject, "err", err)
			continue
		}
		h := fnv.New32a()
		_, _ = h.Write([]byte(engineID))
		in.queues[h.Sum32()%uint32(len(in.queues))] <- inbound{msg: m, engine: engineID, verb: verb}
	}
}

func (in *ingester) work(q <-chan inbound) {
	defer in.wg.Done()
	for x := range q {
		engineID, m := x.engine, x.msg
		switch x.verb {
		case actors.VerbEvents:
			in.events(engineID, m)
		case actors.VerbRegister:
			in.n.onRegister(engineID, m)
		case actors.VerbStatus:
			in.n.onStatus(engineID, m)
		case actors.VerbLookup:
			in.n.onLookup(engineID, m)
		case actors.VerbLoad:
			in.n.onLoad(engineID, m)
		}
	}
}

func (in *ingester) events(engineID string, m *nats.Msg) {
	arrived := time.Now()
	n := in.n
	pid := in.lookup(engineID)
	if pid == nil {
		n.rejected(actors.ReasonUnknownEngine, "events for an unregistered engine", "engine", engineID)
		return
	}
	batch, evErrs, err := ingest.DecodeBatch(engineID, m.Data, n.cfg.Limits)
	if err != nil {
		n.rejected(ingest.Reason(err), "batch rejected", "engine", engineID, "err", err)
		return
	}
	for _, e := range evErrs {
		n.rejected(ingest.Reason(e.Err), "event rejected", "engine", engineID, "request", e.Request,
			"index", e.Index, "type", e.Type, "err", e.Err)
	}
	ctx := n.msgCtx(m)
	var span trace.Span
	ctx, span = n.tracer.Start(ctx, tracing.SpanBatch)
	if span.IsRecording() {
		span.SetAttributes(tracing.AttrEngine.String(engineID), tracing.AttrSeq.Int64(int64(batch.Seq)),
			tracing.AttrEvents.Int(len(batch.Events)))
	}
	span.End() // the batch span marks arrival; request spans hang below it
	n.system.Root.Send(pid, &engine.Batch{Batch: batch, Ctx: ctx, Arrived: arrived})
}

// stop ends intake: the caller has unsubscribed, so nothing more arrives.
func (in *ingester) stop() {
	close(in.in)
	in.wg.Wait()
}

func (n *Node) msgCtx(m *nats.Msg) context.Context {
	if m.Header == nil {
		return context.Background()
	}
	return tracing.Extract(context.Background(), m.Header)
}

// rejected counts and logs one refused input; nothing else changes. The log
// is rate-limited per reason (ratelog), the counter counts every one.
func (n *Node) rejected(reason, msg string, args ...any) {
	n.metrics.Rejected.WithLabelValues(reason).Inc()
	n.rejectLog.Reject(reason, msg, args...)
}

var errUnknownEngine = errors.New("unknown engine")
