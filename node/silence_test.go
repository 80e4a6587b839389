package node_test

import (
	"encoding/json"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// PROTOCOL.md "Engine silence", for a link that fails on the engine's side
// only: the node's NATS is fine, so its own fence never closes, but the
// engine hears the node no more, declares it lost a lease after it last
// heard it and may reuse its blocks a lease after its own last publish. So
// no copy of an engine starts once the node has heard nothing from it for
// lease/2, and whatever the node hears from it next, it first resets the
// engine's requests and resyncs its epoch: the engine may have declared the
// node lost meanwhile, and the message may be an old one, delivered late.
//
// Copy a is held on the one worker and b queued behind it; the engine falls
// silent (the node's liveness clock moves lease/2 on, no message comes); a's
// device call ends, but a is stopped before its chunk becomes ready (its
// bytes may come from blocks the engine reused), and b, refused, never
// starts (both counted, not copy failures). Then the engine is heard again,
// by a heartbeat, a lookup, a late batch of its old epoch or a register
// with the same spec: a and b are released engine_reset, neither copies
// again, nothing of the late batch is applied, a load is refused until the
// engine begins a new epoch, and a new epoch stores and loads. A status
// request (which routers send too) is no word from the engine: b stays
// refused.
func TestAnEngineSilentForHalfALeaseHasNoCopyStarted(t *testing.T) {
	t.Parallel()
	for _, comeback := range []string{"heartbeat", "lookup", "late batch", "register", "router status", "unknown verb"} {
		t.Run(comeback, func(t *testing.T) {
			r := newSilenceRig(t, nil)
			e, dev := r.e, r.dev
			counter := func(name string) float64 { return metricValue(t, e.reg, name, nil) }
			te := e.newEngine("e1", defaultOpts())
			te.register()
			heldAndQueued(t, te, dev)

			r.fallSilent()
			dev.gate <- struct{}{} // a's device call ends, a is stopped; the worker takes b
			testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
				if v := counter("kvactors_transfer_copies_engine_silent_total"); v < 2 {
					return fmt.Errorf("%v of a's copy stopped and b's refused", v)
				}
				return nil
			})
			testkit.NoRecv(t, dev.started, 50*time.Millisecond, "b's copy starting with its engine silent")
			require.Zero(t, counter("kvactors_transfer_failures_total"), "a refusal counted as a copy failure")

			switch comeback {
			case "heartbeat":
				te.request("heartbeat", map[string]any{"epoch": te.epoch, "seq": te.seq})
			case "lookup":
				te.lookup([]string{hash("x", 0)})
			case "late batch": // of the old epoch, sent before the silence, delivered after it
				te.send(added("late", 4), hashesEv("late", 0, hash("late", 0)), blocksEv("late", 0, 0, 5),
					tokensEv("late", 4, 4))
			case "register": // the same spec: a reset all the same
				te.register()
			case "router status", "unknown verb":
				if comeback == "router status" {
					te.sync()
				} else { // rejected, and changes nothing else: no word from the engine either
					require.Contains(t, string(te.request("bogus", map[string]any{})), "unknown verb")
				}
				testkit.NoRecv(t, dev.started, 300*time.Millisecond, "b's copy after the "+comeback)
				require.Zero(t, counter("kvactors_engine_silences_total"), "the %s counted as the engine's word", comeback)
				require.Zero(t, counter("kvactors_engine_resets_total"))
				return
			}
			got := map[string]string{}
			for range 2 {
				rel := recv(t, te.released, "an old request's release")
				got[rel.Request] = rel.Reason
			}
			require.Equal(t, map[string]string{"a": messages.ReasonEngineReset, "b": messages.ReasonEngineReset}, got)
			if comeback != "register" {
				rs := recv(t, te.resync, "the old epoch's resync")
				require.Equal(t, "ep1", rs.Epoch)
				require.Equal(t, 1.0, counter("kvactors_engine_silences_total"))
				// A load now may be one sent before the engine declared the
				// node lost, delivered late into blocks it reused: refused
				// until the engine begins a new epoch.
				lr := te.loadInto("l1", []string{hash("a", 0)}, 4, []int{9})
				require.False(t, lr.OK)
				require.Contains(t, lr.Error, "no load until it begins a new epoch")
			}
			te.sync()
			testkit.NoRecv(t, dev.started, 100*time.Millisecond, "an old request's copy after the reset")

			te.epoch, te.seq = "ep2", 0
			te.send(added("c", 4), hashesEv("c", 0, hash("c", 0)), blocksEv("c", 0, 0, 3), tokensEv("c", 4, 4))
			testkit.Recv(t, dev.started, 5*time.Second, "copy c of the new epoch")
			dev.gate <- struct{}{}
			st := recv(t, te.stored, "stored")
			// Not a (stopped, never stored), nor the late batch of the old epoch.
			require.Equal(t, "c", st.Request)
			dev.gate <- struct{}{} // for the load's copy
			lr := te.loadInto("l2", []string{hash("c", 0)}, 4, []int{9})
			require.True(t, lr.OK, "a load in the new epoch: %s", lr.Error)
		})
	}
}

// PROTOCOL.md "P.E.unregister": each of the N live requests gets exactly
// one released engine_gone, also one that owed no release, and the reply
// says N. So an unregister that ends a silence of lease/2 (not yet an
// expiry) does not first reset the requests engine_reset, as any other
// message ending a silence would (the hearing's new generation still
// fences every copy begun before the silence).
func TestAnUnregisterEndingASilenceReleasesEveryRequestEngineGone(t *testing.T) {
	t.Parallel()
	const lease = 4 * time.Second
	var offset atomic.Int64
	e := startNode(t, func(c *node.Config) { c.Lease = lease },
		node.WithClock(func() time.Time { return time.Now().Add(time.Duration(offset.Load())) }))
	te := e.newEngine("e1", defaultOpts())
	te.register()
	te.fill(0, 1, 1)
	te.send(added("r", 4), hashesEv("r", 0, hash("r", 0)), blocksEv("r", 0, 0, 1), tokensEv("r", 4, 4),
		added("q", 4))
	recv(t, te.stored, "r stored")
	te.sync()

	offset.Store(int64(lease * 5 / 8)) // silent for 5/8 of a lease: not expired
	var un messages.UnregisterReply
	require.NoError(t, json.Unmarshal(te.request("unregister", map[string]any{}), &un))
	require.Equal(t, 2, un.Released, "both live requests released engine_gone")
	got := map[string]string{}
	for range 2 {
		r := recv(t, te.released, "a release")
		got[r.Request] = r.Reason
	}
	require.Equal(t, map[string]string{"r": messages.ReasonEngineGone, "q": messages.ReasonEngineGone}, got)
	testkit.NoRecv(t, te.released, 100*time.Millisecond, "a release more")
}

// A wall clock stepped forward (an NTP step, a resumed VM) is no silence:
// silences are measured on the monotonic clock, so the engine's next word
// resets nothing and its copies go on. Measured on the wall clock, a step
// of lease/2 or more made every engine's next message end a "silence":
// each engine's requests reset and its epoch resynced, at once.
func TestAWallClockStepIsNoSilence(t *testing.T) {
	t.Parallel()
	var step atomic.Int64
	e := startNode(t, func(c *node.Config) { c.Lease = silenceLease },
		node.WithClock(func() time.Time { return testkit.WallStepped(time.Now(), time.Duration(step.Load())) }))
	te := e.newEngine("e1", defaultOpts())
	te.register()
	te.storeOne("a", 1)
	step.Store(int64(silenceLease)) // the system clock jumps a lease ahead
	require.Empty(t, te.heartbeat(te.epoch, te.seq).Error)
	te.storeOne("b", 2)
	require.Zero(t, metricValue(t, e.reg, "kvactors_engine_silences_total", nil), "a wall clock step taken for a silence")
	require.Zero(t, metricValue(t, e.reg, "kvactors_engine_resets_total", nil))
	select {
	case rs := <-te.resync:
		t.Fatalf("a resync of %s after a wall clock step", rs.Epoch)
	default:
	}
}
