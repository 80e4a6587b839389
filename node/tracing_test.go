package node_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/node"
	"github.com/kvactors/kvactors/tracing"
)

func withRecorder(t *testing.T) (*tracetest.SpanRecorder, func(*node.Config)) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return rec, func(c *node.Config) { c.Tracer = tp }
}

func spansNamed(rec *tracetest.SpanRecorder, name string) []sdktrace.ReadOnlySpan {
	var out []sdktrace.ReadOnlySpan
	for _, s := range rec.Ended() {
		if s.Name() == name {
			out = append(out, s)
		}
	}
	return out
}

// A hash lag produces exactly one deferred event (reason hashes) for the
// lagging chunk on the request span, and a store job span once the hash
// arrives (issue 4).
func TestHashLagTracesOneDeferral(t *testing.T) {
	t.Parallel()
	rec, opt := withRecorder(t)
	e := startNode(t, opt)
	te := e.newEngine("e1", defaultOpts())
	te.register()
	h := []string{hash("t", 0), hash("t", 1)}
	te.send(added("r", 8), blocksEv("r", 0, 0, 1, 2), hashesEv("r", 0, h[0]), tokensEv("r", 8, 8))
	recv(t, te.stored, "chunk 0")
	te.send(tokensEv("r", 8, 8)) // another event while the hash still lags: no second deferral
	te.sync()
	te.send(hashesEv("r", 1, h[1]))
	recv(t, te.stored, "chunk 1")
	te.send(finishedEv("r", false, 8, 8))
	recv(t, te.released, "released")

	var req sdktrace.ReadOnlySpan
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		if s := spansNamed(rec, tracing.SpanRequest); len(s) == 1 {
			req = s[0]
			return nil
		}
		return errf("request span not ended yet")
	})
	var deferred []sdktrace.Event
	for _, ev := range req.Events() {
		if ev.Name == tracing.EventDeferred {
			deferred = append(deferred, ev)
		}
	}
	require.Len(t, deferred, 1)
	got := map[string]any{}
	for _, a := range deferred[0].Attributes {
		got[string(a.Key)] = a.Value.AsInterface()
	}
	require.Equal(t, map[string]any{string(tracing.AttrGroup): int64(0), string(tracing.AttrChunk): int64(1),
		string(tracing.AttrReason): "hashes"}, got)

	jobs := spansNamed(rec, tracing.SpanStoreJob)
	require.Len(t, jobs, 2)
	for _, j := range jobs {
		require.Equal(t, req.SpanContext().SpanID(), j.Parent().SpanID(), "store job is a child of the request span")
	}
	require.True(t, jobs[1].StartTime().After(deferred[0].Time), "the second job starts after the deferral")
	copies := spansNamed(rec, tracing.SpanCopy)
	require.Len(t, copies, 2)
	for _, c := range copies {
		require.Equal(t, req.SpanContext().TraceID(), c.SpanContext().TraceID())
	}
}

// A pool that cannot make room records retry events (pool_full) and leaves
// the cursor; once room frees, the same chunks are stored (issue 4). The
// room is held by another request's copy in flight (a request larger than
// the whole pool is stored in parts instead: sched capToRoom).
func TestPoolFullTracesRetriesThenStores(t *testing.T) {
	t.Parallel()
	rec, opt := withRecorder(t)
	dev := &heldDevice{started: make(chan struct{}, 8), gate: make(chan struct{}, 8)}
	e := startNode(t, opt, func(c *node.Config) { c.PoolBytes = 2 * 256; c.WrapDevice = dev.wrap })
	te := e.newEngine("e1", defaultOpts())
	te.register()
	// q's two chunks fill the pool, their copy held: pending, not evictable.
	te.send(added("q", 8), hashesEv("q", 0, hash("g", 0), hash("g", 1)), blocksEv("q", 0, 0, 1, 2), tokensEv("q", 8, 8))
	testkit.Recv(t, dev.started, 5*time.Second, "q's copy")
	hs := []string{hash("f", 0), hash("f", 1)}
	te.send(added("r", 8), hashesEv("r", 0, hs...), blocksEv("r", 0, 0, 3, 4), tokensEv("r", 8, 8))
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		if v := metricValue(t, e.reg, "kvactors_store_retries_total", map[string]string{"reason": "pool_full"}); v < 3 {
			return errf("retries = %v, want >= 3 (timer-driven)", v)
		}
		return nil
	})
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if v := metricValue(t, e.reg, "kvactors_store_retries_pending", nil); v != 1 {
			return errf("retries pending = %v, want 1 (the request waiting for room)", v)
		}
		return nil
	})
	st := te.sync()
	for _, rq := range st.Requests {
		if rq.Request == "r" {
			require.EqualValues(t, 0, rq.Groups[0].Cursor, "no room keeps the cursor")
		}
	}
	// q's copy ends: its chunks are ready, hence evictable, and r's retry
	// stores the same chunks.
	dev.gate <- struct{}{}
	require.Equal(t, []int{0, 1}, chunkIndexes(recv(t, te.stored, "q's chunks")))
	testkit.Recv(t, dev.started, 5*time.Second, "r's copy")
	dev.gate <- struct{}{}
	require.Equal(t, []int{0, 1}, chunkIndexes(recv(t, te.stored, "the retried chunks")))
	te.send(finishedEv("q", true, 8, 8), finishedEv("r", true, 8, 8))
	recv(t, te.released, "released")
	recv(t, te.released, "released")

	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		if len(spansNamed(rec, tracing.SpanRequest)) != 2 {
			return errf("request spans not ended")
		}
		return nil
	})
	retries := 0
	for _, req := range spansNamed(rec, tracing.SpanRequest) {
		for _, ev := range req.Events() {
			if ev.Name == tracing.EventRetry {
				retries++
				require.Contains(t, ev.Attributes, tracing.AttrReason.String("pool_full"))
			}
		}
	}
	require.GreaterOrEqual(t, retries, 3)
	require.Len(t, spansNamed(rec, tracing.SpanStoreJob), 2)
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		if v := metricValue(t, e.reg, "kvactors_store_retries_pending", nil); v != 0 {
			return errf("retries pending = %v after the release, want 0 once its timer fell due", v)
		}
		return nil
	})
}

// The engine's traceparent makes its span the parent of kvactors' batch span,
// and kvactors' stored and released messages carry kvactors' context.
func TestTraceContextFlowsThroughNATSHeaders(t *testing.T) {
	t.Parallel()
	rec, opt := withRecorder(t)
	e := startNode(t, opt)
	te := e.newEngine("e1", defaultOpts())
	te.register()
	engineTP := sdktrace.NewTracerProvider()
	ctx, engineSpan := engineTP.Tracer("engine").Start(context.Background(), "engine.step")
	stored := testkit.Subscribe(t, e.nc, "kvactors.e1.stored")
	released := testkit.Subscribe(t, e.nc, "kvactors.e1.released")

	msg := nats.NewMsg("kvactors.e1.events")
	msg.Data = []byte(`{"epoch":"ep1","seq":1,"events":[{"type":"added","request":"r","prompt_tokens":4},` +
		`{"type":"hashes","request":"r","start":0,"hashes":["` + hash("c", 0) + `"]},` +
		`{"type":"blocks","request":"r","group":0,"start":0,"ids":[1]},` +
		`{"type":"tokens","request":"r","computed":4,"total":4},` +
		`{"type":"finished","request":"r","aborted":false,"computed":4,"total":4}]}`)
	msg.Header = nats.Header{}
	tracing.Inject(ctx, msg.Header)
	msg.Header["Traceparent"] = msg.Header["traceparent"] // engines may capitalise
	delete(msg.Header, "traceparent")
	require.NoError(t, e.nc.PublishMsg(msg))
	engineSpan.End()

	for _, m := range []*nats.Msg{testkit.Recv(t, stored, 5*time.Second, "stored"),
		testkit.Recv(t, released, 5*time.Second, "released")} {
		sc := trace.SpanContextFromContext(tracing.Extract(context.Background(), m.Header))
		require.True(t, sc.IsValid(), "%s carries a valid traceparent", m.Subject)
		require.Equal(t, engineSpan.SpanContext().TraceID(), sc.TraceID(), "same trace as the engine")
	}
	batches := spansNamed(rec, tracing.SpanBatch)
	require.Len(t, batches, 1)
	require.Equal(t, engineSpan.SpanContext().SpanID(), batches[0].Parent().SpanID())
	require.True(t, batches[0].Parent().IsRemote())
}

// An engine's baggage and oversized tracestate change nothing but its
// trace: the request span continues the engine's trace with a tracestate
// cut to tracing.MaxTraceState, and stored and released carry a traceparent
// of the same trace, no baggage and no more tracestate than that; with
// tracing off, only the engine's traceparent goes back.
func TestEngineBaggageAndTraceStateAreNotEchoed(t *testing.T) {
	t.Parallel()
	const traceID, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
	for _, traced := range []bool{true, false} {
		t.Run(fmt.Sprintf("traced=%v", traced), func(t *testing.T) {
			var opts []func(*node.Config)
			var rec *tracetest.SpanRecorder
			wantState := ""
			if traced {
				var opt func(*node.Config)
				rec, opt = withRecorder(t)
				opts = append(opts, opt)
				wantState = "engine=kept"
			}
			e := startNode(t, opts...)
			te := e.newEngine("e1", defaultOpts())
			te.register()
			stored := testkit.Subscribe(t, e.nc, "kvactors.e1.stored")
			released := testkit.Subscribe(t, e.nc, "kvactors.e1.released")

			te.seq++
			body, err := json.Marshal(map[string]any{"epoch": te.epoch, "seq": te.seq, "events": []map[string]any{
				added("r", 4), hashesEv("r", 0, hash("b", 0)), blocksEv("r", 0, 0, 1), tokensEv("r", 4, 4),
				finishedEv("r", false, 4, 4)}})
			require.NoError(t, err)
			msg := nats.NewMsg("kvactors.e1.events")
			msg.Data = body
			msg.Header = node.HostileTraceHeader("00-" + traceID + "-" + parent + "-01")
			require.NoError(t, e.nc.PublishMsg(msg))

			for _, m := range []*nats.Msg{testkit.Recv(t, stored, 5*time.Second, "stored"),
				testkit.Recv(t, released, 5*time.Second, "released")} {
				h := tracing.HeaderCarrier(m.Header)
				require.Zero(t, len(h.Get("baggage")), "%s echoes no baggage", m.Subject)
				require.True(t, h.Get("tracestate") == wantState, "%s: tracestate of %d bytes, want %q",
					m.Subject, len(h.Get("tracestate")), wantState)
				sc := trace.SpanContextFromContext(tracing.Extract(context.Background(), m.Header))
				require.True(t, sc.IsValid(), "%s carries a valid traceparent", m.Subject)
				require.Equal(t, traceID, sc.TraceID().String(), "%s: same trace as the engine", m.Subject)
			}
			if !traced {
				return
			}
			testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
				if len(spansNamed(rec, tracing.SpanRequest)) != 1 {
					return errf("request span not ended")
				}
				return nil
			})
			req := spansNamed(rec, tracing.SpanRequest)[0]
			require.Equal(t, traceID, req.SpanContext().TraceID().String(), "the request continues the engine's trace")
			require.True(t, req.SpanContext().TraceState().String() == wantState, "the request keeps a tracestate of %d bytes, want %q",
				len(req.SpanContext().TraceState().String()), wantState)
			batch := spansNamed(rec, tracing.SpanBatch)
			require.Len(t, batch, 1)
			require.Equal(t, parent, batch[0].Parent().SpanID().String())
		})
	}
}

// A lookup's and a load's replies carry the trace context they were made
// in (docs/PROTOCOL.md): with tracing on, kvactors' own kvactors.lookup or
// kvactors.load span, a child of the engine's, not the engine's span
// passed back, so an engine's trace shows the reply as the node's work.
func TestLookupAndLoadRepliesCarryTheirSpan(t *testing.T) {
	t.Parallel()
	rec, opt := withRecorder(t)
	e := startNode(t, opt)
	te := e.newEngine("e1", defaultOpts())
	te.register()
	const engineSpan = "00f067aa0ba902b7"
	for _, c := range []struct{ verb, span, body string }{
		{"lookup", tracing.SpanLookup, `{"hashes":["` + hash("x", 0) + `"]}`},
		{"load", tracing.SpanLoad, `{"request":"l","hashes":["` + hash("x", 0) + `"],"num_tokens":4,"blocks":[[1]]}`},
	} {
		reply := requestWithHeader(t, e, c.verb, c.body,
			nats.Header{"traceparent": {"00-4bf92f3577b34da6a3ce929d0e0e4736-" + engineSpan + "-01"}})
		var s sdktrace.ReadOnlySpan
		testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
			if got := spansNamed(rec, c.span); len(got) == 1 {
				s = got[0]
				return nil
			}
			return errf("no ended %s span yet", c.span)
		})
		require.Equal(t, engineSpan, s.Parent().SpanID().String(), "%s: the engine's span is the parent", c.span)
		sc := trace.SpanContextFromContext(tracing.Extract(context.Background(), reply.Header))
		require.Equal(t, s.SpanContext().TraceID(), sc.TraceID(), "the %s reply: same trace", c.verb)
		require.Equal(t, s.SpanContext().SpanID().String(), sc.SpanID().String(), "the %s reply carries the %s span",
			c.verb, c.span)
	}
}

// Trace headers are read under any capitalisation, and one that is not
// W3C's (docs/OBSERVABILITY.md) is ignored and not counted: the message is
// handled as one without it, its kvactors.lookup span starting a trace of
// its own, its reply carrying that span. A malformed tracestate alone does
// not cost the engine's traceparent.
func TestTraceHeadersAnyCaseAndMalformedOnesAreIgnored(t *testing.T) {
	t.Parallel()
	rec, opt := withRecorder(t)
	e := startNode(t, opt)
	te := e.newEngine("e1", defaultOpts())
	te.register()
	const tid, sid = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
	valid := "00-" + tid + "-" + sid + "-01"
	for i, c := range []struct {
		h      nats.Header
		parent bool // the engine's span is the lookup span's parent
	}{
		{nats.Header{"TRACEPARENT": {valid}}, true},
		{nats.Header{"TraceParent": {valid}, "TRACESTATE": {"a=1"}}, true},
		{nats.Header{"traceparent": {valid}, "tracestate": {"not a tracestate!"}}, true},
		{nats.Header{"traceparent": {"garbage"}}, false},
		{nats.Header{"traceparent": {""}}, false},
		{nats.Header{"traceparent": {"00-00000000000000000000000000000000-" + sid + "-01"}}, false}, // zero trace id
		{nats.Header{"traceparent": {"00-" + tid + "-0000000000000000-01"}}, false},                 // zero span id
		{nats.Header{"traceparent": {"ff-" + tid + "-" + sid + "-01"}}, false},                      // version ff
		{nats.Header{"traceparent": {valid + "-extra"}}, false},                                     // version 00 has no more
		{nats.Header{"traceparent": {strings.ToUpper(valid)}}, false},                               // hex is lowercase
	} {
		reply := requestWithHeader(t, e, "lookup", `{"hashes":["`+hash("x", i)+`"]}`, c.h)
		require.Contains(t, string(reply.Data), `"hit_tokens":0`, "lookup %d (%v) is answered", i, c.h)

		var s sdktrace.ReadOnlySpan
		testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
			if got := spansNamed(rec, tracing.SpanLookup); len(got) == i+1 {
				s = got[i]
				return nil
			}
			return errf("lookup %d's span not ended yet", i)
		})
		if c.parent {
			require.Equal(t, sid, s.Parent().SpanID().String(), "lookup %d (%v): the engine's span is the parent", i, c.h)
			require.Equal(t, tid, s.SpanContext().TraceID().String())
		} else {
			require.False(t, s.Parent().IsValid(), "lookup %d (%v): no parent", i, c.h)
			require.NotEqual(t, tid, s.SpanContext().TraceID().String())
		}
		sc := trace.SpanContextFromContext(tracing.Extract(context.Background(), reply.Header))
		require.Equal(t, s.SpanContext().SpanID(), sc.SpanID(), "lookup %d's reply carries its span", i)
	}
	require.Zero(t, metricValue(t, e.reg, "kvactors_events_rejected_total", nil), "trace headers are not counted")
}

// requestWithHeader sends body on e1's verb subject with header h and
// returns the reply.
func requestWithHeader(t *testing.T, e *env, verb, body string, h nats.Header) *nats.Msg {
	t.Helper()
	m := nats.NewMsg("kvactors.e1." + verb)
	m.Data, m.Header, m.Reply = []byte(body), h, testkit.EngineInbox("e1")
	replies := testkit.Subscribe(t, e.nc, m.Reply)
	require.NoError(t, e.nc.PublishMsg(m))
	return testkit.Recv(t, replies, 5*time.Second, "the "+verb+" reply")
}
