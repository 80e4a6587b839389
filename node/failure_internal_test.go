package node

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

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
	n, nc, dir := startInternal(t, nil)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	var arm atomic.Bool
	n.mu.Lock()
	n.editEngine = func(d *engine.Deps) {
		gen := d.Session
		d.Session = func() uint64 {
			if arm.CompareAndSwap(true, false) {
				panic("engine actor failure injected")
			}
			return gen()
		}
	}
	n.mu.Unlock()
	registerOneEngine(t, nc, dir, "e1")
	heartbeat := func() string {
		t.Helper()
		reply, err := nc.Request("kvactors.e1.heartbeat", []byte(`{"epoch":"a","seq":1}`), 5*time.Second)
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
	require.Equal(t, messages.Released{Request: "q", Epoch: "a", RSeq: 1, Reason: messages.ReasonEngineGone}, rel)
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
	require.Equal(t, 1.0, testutil.ToFloat64(n.metrics.Engines.Failures))
	require.NoError(t, nc.Flush())
	testkit.NoRecv(t, released, 50*time.Millisecond, "a second release of q")

	registerOneEngine(t, nc, dir, "e1") // the engine registers again (and starts a new epoch)
	require.NoError(t, nc.Publish("kvactors.e1.events", []byte(`{"epoch":"b","seq":1,"events":[]}`)))
	reply, err := nc.Request("kvactors.e1.heartbeat", []byte(`{"epoch":"b","seq":1}`), 5*time.Second)
	require.NoError(t, err)
	require.Contains(t, string(reply.Data), `"applied":1`)
	require.Equal(t, 1.0, testutil.ToFloat64(live))
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
	n, nc, dir := startInternal(t, nil)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	var arm atomic.Bool
	n.mu.Lock()
	n.editEngine = func(d *engine.Deps) {
		gen := d.Session
		d.Session = func() uint64 {
			if arm.CompareAndSwap(true, false) {
				panic("engine actor failure injected")
			}
			return gen()
		}
		d.Log = slog.New(panicsOnLine{msg: "engine actor failed; ending the engine as on unregister"})
	}
	n.mu.Unlock()
	registerOneEngine(t, nc, dir, "e1")
	heartbeat := func() string {
		t.Helper()
		reply, err := nc.Request("kvactors.e1.heartbeat", []byte(`{"epoch":"a","seq":1}`), 5*time.Second)
		require.NoError(t, err)
		return string(reply.Data)
	}
	require.NoError(t, nc.Publish("kvactors.e1.events",
		[]byte(`{"epoch":"a","seq":1,"events":[{"type":"added","request":"q","prompt_tokens":4}]}`)))
	require.Contains(t, heartbeat(), `"applied":1`)
	live := n.metrics.Engines.EnginesLive

	arm.Store(true)
	require.NoError(t, nc.Publish("kvactors.e1.events",
		[]byte(`{"epoch":"a","seq":2,"events":[{"type":"tokens","request":"q","computed":4,"total":4}]}`)))
	var rel messages.Released
	require.NoError(t, json.Unmarshal(testkit.Recv(t, released, 5*time.Second, "q's release").Data, &rel))
	require.Equal(t, messages.Released{Request: "q", Epoch: "a", RSeq: 1, Reason: messages.ReasonAborted}, rel)
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
	registerOneEngine(t, nc, dir, "e1") // the engine registers again (and starts a new epoch)
	require.NoError(t, nc.Publish("kvactors.e1.events", []byte(`{"epoch":"b","seq":1,"events":[]}`)))
	reply, err := nc.Request("kvactors.e1.heartbeat", []byte(`{"epoch":"b","seq":1}`), 5*time.Second)
	require.NoError(t, err)
	require.Contains(t, string(reply.Data), `"applied":1`)
}
