package node

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// failWhenArmed makes the engines registered from now on fail (panic) in
// their next turn that reads the fence generation (a batch's) once arm is
// set; edit, if not nil, edits their deps further.
func failWhenArmed(n *Node, arm *atomic.Bool, edit func(*engine.Deps)) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.editEngine = func(d *engine.Deps) {
		gen := d.Session
		d.Session = func() uint64 {
			if arm.CompareAndSwap(true, false) {
				panic("engine actor failure injected")
			}
			return gen()
		}
		if edit != nil {
			edit(d)
		}
	}
}

// An engine actor that panics mid-turn (here: in the turn of a batch, which
// holds that batch's credit) ends its engine as an unregister does
// (its guardian strategy, actors/engine): its request is released engine_gone, the node
// forgets the engine (its heartbeat is refused as unknown, so it registers
// again), the failed batch's bytes go back to the intake budget, its
// segments are unmapped, the live-engines gauge drops, and a new register
// serves the engine again. Under protoactor's default restart the request
// was released aborted, the node went on routing to the restarted actor
// with a fresh sequencer, and the failed batch's credit was never returned.
func TestAFailedEngineActorEndsTheEngineOnTheNode(t *testing.T) {
	t.Parallel()
	n, nc, dir := failAndForget(t, nil, messages.ReasonEngineGone)
	live := n.metrics.Engines.EnginesLive
	require.Equal(t, 1.0, testutil.ToFloat64(n.metrics.Engines.Failures))
	registerAgain(t, nc, dir)
	require.Equal(t, 1.0, testutil.ToFloat64(live))
}

// failAndForget registers e1 with engine actors that panic once armed
// (edit changes their deps further), has request q of epoch a, arms the
// failure with q's next batch, and checks the node's side of the end: q
// released once with reason, then the engine unknown to its heartbeat, the
// intake's bytes back, its segments unmapped and the live gauge at 0.
// Later engines of the node fail no more.
func failAndForget(t *testing.T, edit func(*engine.Deps), reason string) (*Node, *nats.Conn, string) {
	t.Helper()
	n, nc, dir := startInternal(t, nil)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	var arm atomic.Bool
	failWhenArmed(n, &arm, edit)
	registerOneEngine(t, nc, dir, "e1")
	heartbeat := func() string {
		t.Helper()
		reply, err := testkit.EngineRequest(nc, "e1", "kvactors.e1.heartbeat", []byte(`{"epoch":"a","seq":1}`), 5*time.Second)
		require.NoError(t, err)
		return string(reply.Data)
	}
	require.NoError(t, nc.Publish("kvactors.e1.events",
		[]byte(`{"epoch":"a","seq":1,"events":[{"type":"added","request":"q","prompt_tokens":4}]}`)))
	require.Contains(t, heartbeat(), `"applied":1`)
	live := n.metrics.Engines.EnginesLive
	require.Equal(t, 1.0, testutil.ToFloat64(live))

	arm.Store(true)
	require.NoError(t, nc.Publish("kvactors.e1.events",
		[]byte(`{"epoch":"a","seq":2,"events":[{"type":"tokens","request":"q","computed":4,"total":4}]}`)))
	var rel messages.Released
	require.NoError(t, json.Unmarshal(testkit.Recv(t, released, 5*time.Second, "q's release").Data, &rel))
	require.Equal(t, messages.Released{Request: "q", Epoch: "a", RSeq: 1, Reason: reason}, rel)
	require.False(t, arm.Load(), "the failure was injected")
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		switch {
		case !strings.Contains(heartbeat(), "unknown engine"):
			return fmt.Errorf("the failed engine is still known")
		case n.ingest.pending.Load() != 0:
			return fmt.Errorf("%d intake bytes still held", n.ingest.pending.Load())
		case n.mappedNow() != 0:
			return fmt.Errorf("%d segments still mapped", n.mappedNow())
		case testutil.ToFloat64(live) != 0:
			return fmt.Errorf("the failed engine still counted live")
		}
		return nil
	})
	require.NoError(t, nc.Flush())
	testkit.NoRecv(t, released, 50*time.Millisecond, "a second release of q")
	n.mu.Lock()
	n.editEngine = nil
	n.mu.Unlock()
	return n, nc, dir
}

// registerAgain registers e1 again (a new epoch, b) and checks that it is
// served: a batch of b is applied.
func registerAgain(t *testing.T, nc *nats.Conn, dir string) {
	t.Helper()
	registerOneEngine(t, nc, dir, "e1")
	require.NoError(t, nc.Publish("kvactors.e1.events", []byte(`{"epoch":"b","seq":1,"events":[]}`)))
	reply, err := testkit.EngineRequest(nc, "e1", "kvactors.e1.heartbeat", []byte(`{"epoch":"b","seq":1}`), 5*time.Second)
	require.NoError(t, err)
	require.Contains(t, string(reply.Data), `"applied":1`)
}

// panicsOnLine is a log handler that discards records but panics on one
// message.
type panicsOnLine struct{ msg string }

func (h panicsOnLine) Enabled(context.Context, slog.Level) bool { return true }
func (h panicsOnLine) Handle(_ context.Context, r slog.Record) error {
	if r.Message == h.msg {
		panic("log handler failure injected: " + h.msg)
	}
	return nil
}
func (h panicsOnLine) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h panicsOnLine) WithGroup(string) slog.Handler      { return h }

// An engine actor whose end fails too (its log handler panics on the
// failure line, before the retire: the reviewer's case) still has the node
// forget the engine: its heartbeat is answered "unknown engine", the
// intake credit comes back, the segments are unmapped and the gauge drops;
// its request gets one release (aborted: the actor stopped as a last
// resort) and the engine can register again.
func TestAnEngineActorFailingInsideItsEndIsStillForgottenByTheNode(t *testing.T) {
	t.Parallel()
	_, nc, dir := failAndForget(t, func(d *engine.Deps) {
		d.Log = slog.New(panicsOnLine{msg: "engine actor failed; ending the engine as on unregister"})
	}, messages.ReasonAborted)
	registerAgain(t, nc, dir)
}

// panickyStore fails the request actor whose store decision calls it the
// n-th time (a bug, say), as its own turn: PrepareStoreInto runs there.
type panickyStore struct {
	request.Store
	calls, n atomic.Int32
}

func (s *panickyStore) PrepareStoreInto(out *hostpool.Prepared, keys []messages.Key, sizes []int64) error {
	if s.calls.Add(1) == s.n.Load() {
		panic("request actor failure injected")
	}
	return s.Store.PrepareStoreInto(out, keys, sizes)
}

// A request actor that fails while its store copy runs is released
// (aborted) only once that copy has ended: the engine may reuse the
// blocks a copy reads only after it. The engine and its other requests
// carry on.
func TestAFailedRequestIsReleasedOnTheNodeOnlyOnceItsCopyEnds(t *testing.T) {
	t.Parallel()
	dev := &toldDevice{copies: make(chan backend.Direction, 16), hold: make(chan struct{})}
	release := sync.OnceFunc(func() { close(dev.hold) })
	t.Cleanup(release)
	n, nc, dir := startInternal(t, func(c *Config) {
		c.WrapDevice = func(d backend.Attachment) backend.Attachment { dev.Attachment = d; return dev }
	})
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	resyncs := testkit.Subscribe(t, nc, "kvactors.e1.resync")
	store := &panickyStore{}
	store.n.Store(2) // a's second store decision
	n.mu.Lock()
	n.editEngine = func(d *engine.Deps) { store.Store = d.Request.Store; d.Request.Store = store }
	n.mu.Unlock()
	registerOneEngine(t, nc, dir, "e1")
	require.NoError(t, nc.Publish("kvactors.e1.events", []byte(`{"epoch":"a","seq":1,"events":[`+
		`{"type":"added","request":"a","prompt_tokens":8},{"type":"hashes","request":"a","start":0,"hashes":["6161616130303030","6262626230303030"]},`+
		`{"type":"blocks","request":"a","group":0,"start":0,"ids":[1,2]},{"type":"tokens","request":"a","computed":4,"total":4}]}`)))
	testkit.Recv(t, dev.copies, 5*time.Second, "a's first chunk's copy, held")
	require.NoError(t, nc.Publish("kvactors.e1.events", []byte(`{"epoch":"a","seq":2,"events":[`+
		`{"type":"tokens","request":"a","computed":8,"total":9}]}`)))
	failures := n.metrics.Store.RequestFailure
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if testutil.ToFloat64(failures) != 1 {
			return fmt.Errorf("a's actor has not failed yet (%d store decisions)", store.calls.Load())
		}
		return nil
	})
	require.NoError(t, nc.Flush())
	testkit.NoRecv(t, released, 100*time.Millisecond, "a released while its copy runs")

	release()
	var rel messages.Released
	require.NoError(t, json.Unmarshal(testkit.Recv(t, released, 5*time.Second, "a's release").Data, &rel))
	require.Equal(t, messages.Released{Request: "a", Epoch: "a", RSeq: 1, Reason: messages.ReasonAborted}, rel)

	// The engine carries on: the failure resynced epoch a (the node forgot
	// a while the engine may still run it), and in the next epoch another
	// request is stored and released.
	var rs messages.Resync
	require.NoError(t, json.Unmarshal(testkit.Recv(t, resyncs, 5*time.Second, "the failure's resync").Data, &rs))
	require.Equal(t, "a", rs.Epoch)
	require.NoError(t, nc.Publish("kvactors.e1.events", []byte(`{"epoch":"b","seq":1,"events":[`+
		`{"type":"added","request":"b","prompt_tokens":4},{"type":"hashes","request":"b","start":0,"hashes":["6363636330303030"]},`+
		`{"type":"blocks","request":"b","group":0,"start":0,"ids":[3]},{"type":"tokens","request":"b","computed":4,"total":4},`+
		`{"type":"finished","request":"b"}]}`)))
	require.NoError(t, json.Unmarshal(testkit.Recv(t, released, 5*time.Second, "b's release").Data, &rel))
	require.Equal(t, messages.Released{Request: "b", Epoch: "b", RSeq: 1, Reason: messages.ReasonFinished}, rel)
	require.NoError(t, nc.Flush())
	testkit.NoRecv(t, released, 50*time.Millisecond, "a second release")
	require.Equal(t, 1.0, testutil.ToFloat64(failures))
}
