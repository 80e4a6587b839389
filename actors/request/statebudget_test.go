package request_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// A request actor gives its request's charge back to the engine's
// StateBudget however it ends: stopped unreleased (its engine's end),
// failed (a panic: the failure is injected as a nil store, which the first
// store decision dereferences), or released and kept idle. A charge kept
// would leave the engine's later requests refused for good.
func TestARequestActorGivesItsStateChargeBackHoweverItEnds(t *testing.T) {
	_, nc := testkit.NATS(t)
	for _, end := range []string{"stopped", "failed", "released"} {
		t.Run(end, func(t *testing.T) {
			rig := newHeldRig(t, nc, 16)
			deps := rig.deps
			lay := *deps.Layout
			lay.Budget = sched.NewStateBudget(0)
			deps.Layout = &lay
			if end == "failed" {
				deps.Store = nil
			}
			spawner := request.NewSpawner()
			pid := spawner.Spawn(rig.system.Root, &deps, &messages.Event{Type: messages.EvAdded, Request: "r",
				PromptTokens: 8, MaxOffloadTokens: -1}, context.Background())
			evs := []messages.Event{{Type: messages.EvHashes, Request: "r", Hashes: []messages.Hash{"h0", "h1"}},
				{Type: messages.EvBlocks, Request: "r", IDs: []messages.BlockID{1, 2}}}
			if end != "stopped" {
				evs = append(evs, messages.Event{Type: messages.EvTokens, Request: "r", Computed: 8, Total: 8})
			}
			applied := make(chan struct{}, 1)
			rig.system.Root.Send(pid, &request.Events{Events: evs,
				Applied: actors.SignalFunc(func() { applied <- struct{}{} })})
			switch end {
			case "stopped":
				testkit.Recv(t, applied, 5*time.Second, "events applied")
				require.Positive(t, lay.Budget.Held())
				require.NoError(t, rig.system.Root.StopFuture(pid).Wait())
			case "released":
				job := testkit.Recv(t, rig.seen, 5*time.Second, "store job").(*transfer.Submit)
				require.Positive(t, lay.Budget.Held())
				require.NoError(t, job.Store.Copy(job.Dir, job.Chunks, nil))
				rig.system.Root.Send(pid, &request.Events{Events: []messages.Event{
					{Type: messages.EvFinished, Request: "r", Computed: 8, Total: 8}}})
				rig.system.Root.Send(pid, &transfer.JobDone{ID: job.ID})
			}
			testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
				if h := lay.Budget.Held(); h != 0 {
					return fmt.Errorf("the engine's budget still holds %d bytes", h)
				}
				return nil
			})
		})
	}
}
