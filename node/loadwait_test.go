package node_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/node"
	"github.com/kvactors/kvactors/tracing"
)

// loadSpan waits for the ended kvactors.load span of request req.
func loadSpan(t *testing.T, rec *tracetest.SpanRecorder, req string) sdktrace.ReadOnlySpan {
	t.Helper()
	var got sdktrace.ReadOnlySpan
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		for _, s := range spansNamed(rec, tracing.SpanLoad) {
			for _, a := range s.Attributes() {
				if a.Key == tracing.AttrRequest && a.Value.AsString() == req {
					got = s
					return nil
				}
			}
		}
		return errf("no ended load span of %q yet", req)
	})
	return got
}

// eventsOf lists a span's events as "name k=v …" in order, attributes
// named without their kvactors. prefix; wait_ms (a duration) and
// RecordError's exception event are left out.
func eventsOf(s sdktrace.ReadOnlySpan) []string {
	var out []string
	for _, ev := range s.Events() {
		if ev.Name == "exception" {
			continue
		}
		line := ev.Name
		for _, a := range ev.Attributes {
			if a.Key == tracing.AttrWaitMS {
				continue
			}
			line += fmt.Sprintf(" %s=%v", string(a.Key)[len("kvactors."):], a.Value.AsInterface())
		}
		out = append(out, line)
	}
	return out
}

func loadWaits(t *testing.T, e *env, outcome string) float64 {
	return metricValue(t, e.reg, "kvactors_load_waits_total", map[string]string{"outcome": outcome})
}

// A load that finds its key pending in another copy (here being read back
// from disk by a first load) and waits for it is seen: counted
// (kvactors_load_waits_total{outcome="loaded"}, _retries_total, and its
// wait in _wait_seconds), and traced on its one kvactors.load span, which
// covers the wait and the copy: a deferred event, a retry per try again,
// wait_ended with the outcome (docs/OBSERVABILITY.md).
func TestALoadWaitingForAPendingKeyIsCountedAndTraced(t *testing.T) {
	t.Parallel()
	rec, opt := withRecorder(t)
	rb := startReadingBack(t, opt)
	te := rb.te
	second := te.loadAsync("l2", rb.a, 4, []int{11})
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		if n := metricValue(t, rb.e.reg, "kvactors_load_waits_total", nil); n != 0 {
			return fmt.Errorf("a wait ended (%v) before the read back was released", n)
		}
		for _, s := range rec.Started() {
			if s.Name() == tracing.SpanLoad && len(s.Events()) > 0 {
				return nil
			}
		}
		return errf("the second load's span has no deferred event yet")
	})
	rb.release()
	require.True(t, loadReplyOf(t, rb.first, "the first load's reply").OK)
	r2 := loadReplyOf(t, second, "the second load's reply")
	require.True(t, r2.OK, r2.Error)

	require.Equal(t, 1.0, loadWaits(t, rb.e, "loaded"))
	require.Equal(t, 1.0, metricValue(t, rb.e.reg, "kvactors_load_waits_total", nil), "one wait, no other outcome")
	require.GreaterOrEqual(t, metricValue(t, rb.e.reg, "kvactors_load_retries_total", nil), 1.0)
	require.Equal(t, 1.0, metricValue(t, rb.e.reg, "kvactors_load_wait_seconds", nil), "one wait timed")

	s := loadSpan(t, rec, "l2")
	require.Equal(t, codes.Unset, s.Status().Code)
	ev := eventsOf(s)
	require.Equal(t, "deferred reason=pending", ev[0])
	require.Equal(t, "retry reason=pending attempt=1", ev[1])
	require.Equal(t, "wait_ended outcome=loaded", ev[len(ev)-1])
	var copied bool
	for _, a := range s.Attributes() {
		copied = copied || a.Key == tracing.AttrChunks && a.Value.AsInt64() == 1
	}
	require.True(t, copied, "the load actor ended the same span, naming its chunks")
	first := loadSpan(t, rec, "l1")
	require.Empty(t, eventsOf(first), "the first load did not wait")
}

// A load whose pending key is still pending at Config.LoadWait fails as a
// miss, counted timed_out, its span ended with an error after its deferred,
// retry and wait_ended events.
func TestALoadWaitTimingOutIsCountedAndTraced(t *testing.T) {
	t.Parallel()
	rec, opt := withRecorder(t)
	rb := startReadingBack(t, opt, func(c *node.Config) { c.LoadWait = 200 * time.Millisecond })
	r2 := loadReplyOf(t, rb.te.loadAsync("l2", rb.a, 4, []int{11}), "the waiting load's reply past the load wait")
	require.False(t, r2.OK)
	require.Equal(t, 1.0, loadWaits(t, rb.e, "timed_out"))
	require.Zero(t, loadWaits(t, rb.e, "loaded"))
	require.Equal(t, 1.0, metricValue(t, rb.e.reg, "kvactors_load_wait_seconds", nil))

	s := loadSpan(t, rec, "l2")
	require.Equal(t, codes.Error, s.Status().Code)
	require.Contains(t, s.Status().Description, "pending in another copy")
	ev := eventsOf(s)
	require.Equal(t, "deferred reason=pending", ev[0])
	require.Contains(t, ev, "retry reason=pending attempt=1", "the last try at the load wait")
	require.Equal(t, "wait_ended outcome=timed_out", ev[len(ev)-1])
	rb.release()
	require.True(t, loadReplyOf(t, rb.first, "the first load's reply").OK)
}

// A load refused before any load actor (here a miss: a key never stored)
// still has its kvactors.load span, ended with an error status.
func TestARefusedLoadEndsItsSpanWithAnError(t *testing.T) {
	t.Parallel()
	rec, opt := withRecorder(t)
	e := startNode(t, opt)
	te := e.newEngine("e1", defaultOpts())
	te.register()
	r := loadReplyOf(t, te.loadAsync("miss", []string{hash("never", 0)}, 4, []int{1}), "the missing load's reply")
	require.False(t, r.OK)
	s := loadSpan(t, rec, "miss")
	require.Equal(t, codes.Error, s.Status().Code)
	require.Contains(t, s.Status().Description, "not ready")
	require.Empty(t, eventsOf(s), "no wait")
	require.Zero(t, metricValue(t, e.reg, "kvactors_load_waits_total", nil), "a miss does not wait")
}
