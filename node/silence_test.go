package node_test

import (
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// PROTOCOL.md "Fencing, node side", for a link that fails on the engine's
// side only: the node's NATS is fine, so its own fence never closes, but
// the engine hears the node no more, declares it lost a lease after it
// last heard it and may reuse its blocks a lease after its own last
// publish. So no copy of an engine starts once the node has heard nothing
// from it for lease/2 (a live engine speaks every lease/4). Here copy a is
// held on the one worker and b queued behind it; the engine falls silent
// (the node's liveness clock moves lease/2 on, no message comes); a ends
// and b, refused, never starts (counted, not a copy failure). Then:
//   - "engine speaks": a message of the engine (its link back before it
//     declared anything) lets b's retry copy;
//   - "engine registers again": having declared the node lost, it
//     registers again: after that silence the register is an engine reset
//     even with the same spec, a and b are released engine_reset and b
//     never copies; a new epoch stores.
func TestAnEngineSilentForHalfALeaseHasNoCopyStarted(t *testing.T) {
	for _, comeback := range []string{"engine speaks", "engine registers again"} {
		t.Run(comeback, func(t *testing.T) {
			const lease = time.Minute // no expiry, no session tick in reach
			start := time.Unix(1_800_000_000, 0)
			var clock atomic.Int64
			clock.Store(start.UnixNano())
			dev := &heldDevice{started: make(chan struct{}, 8), gate: make(chan struct{}, 8)}
			e := startNode(t, func(c *node.Config) {
				c.Lease = lease
				c.Transfer.Workers = 1
				c.WrapDevice = dev.wrap
			}, node.WithClock(func() time.Time { return time.Unix(0, clock.Load()) }))
			t.Cleanup(func() { close(dev.gate) })
			silent := func() float64 {
				return metricValue(t, e.reg, "kvactors_transfer_copies_engine_silent_total", nil)
			}
			te := e.newEngine("e1", defaultOpts())
			te.register()
			heldAndQueued(t, te, dev)

			clock.Store(start.Add(lease / 2).UnixNano()) // nothing heard since start
			dev.gate <- struct{}{}                       // a ends; the worker takes b
			testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
				if v := silent(); v < 1 {
					return fmt.Errorf("b's copy not refused yet")
				}
				return nil
			})
			testkit.NoRecv(t, dev.started, 50*time.Millisecond, "b's copy starting with its engine silent")
			require.Zero(t, metricValue(t, e.reg, "kvactors_transfer_failures_total", nil),
				"a refusal counted as a copy failure")

			if comeback == "engine speaks" {
				te.sync() // heard now: b's retry may copy
				testkit.Recv(t, dev.started, 10*time.Second, "b's retried copy once the engine spoke")
				dev.gate <- struct{}{}
				testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
					for {
						select {
						case st := <-te.stored:
							if st.Request == "b" {
								return nil
							}
						default:
							return fmt.Errorf("b not stored yet")
						}
					}
				})
				return
			}

			te.register() // after lease/2 of silence: an engine reset
			got := map[string]string{}
			for range 2 {
				rel := recv(t, te.released, "an old request's release")
				got[rel.Request] = rel.Reason
			}
			require.Equal(t, map[string]string{"a": messages.ReasonEngineReset, "b": messages.ReasonEngineReset}, got)
			require.Equal(t, 1.0, metricValue(t, e.reg, "kvactors_engine_resets_total", nil))
			te.sync()
			testkit.NoRecv(t, dev.started, 100*time.Millisecond, "b's copy after the reset")

			te.epoch, te.seq = "ep2", 0
			te.send(added("c", 4), hashesEv("c", 0, hash("c", 0)), blocksEv("c", 0, 0, 3), tokensEv("c", 4, 4))
			testkit.Recv(t, dev.started, 5*time.Second, "copy c of the new epoch")
			dev.gate <- struct{}{}
			st := recv(t, te.stored, "stored")
			if st.Request == "a" { // a's stored, published before the reset
				st = recv(t, te.stored, "stored c")
			}
			require.Equal(t, "c", st.Request)
		})
	}
}
