package request_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/actors/transfer"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// A request whose ready chunks need more than an empty pool holds is
// stored in parts, at most the pool a decision (sched capToRoom): on a
// pool of 4 chunks, request r's 6 ready chunks go as 4, then 2. Its first
// part is in the pool already (stored by q), so that decision makes no job
// and the actor decides again at once (sched.Effects.More) instead of
// waiting for an event that may never come; r is released once all of it
// is stored, nothing given up.
func TestARequestPastThePoolIsStoredInParts(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e.released")
	rig := newHeldRig(t, nc, 4)
	system, deps, seen := rig.system, rig.deps, rig.seen
	hs := []messages.Hash{"h0", "h1", "h2", "h3", "h4", "h5"}
	spawn := func(id string, n int) (send func(...messages.Event)) {
		pid := request.NewSpawner().Spawn(system.Root, &deps, &messages.Event{Type: messages.EvAdded, Request: id,
			PromptTokens: 4 * n, MaxOffloadTokens: -1}, context.Background())
		return func(evs ...messages.Event) {
			for i := range evs {
				evs[i].Request = id
			}
			system.Root.Send(pid, &request.Events{Events: evs, Arrived: time.Now()})
		}
	}
	complete := func(j *transfer.Submit) {
		require.NoError(t, j.Store.Copy(j.Dir, j.Chunks, nil))
		system.Root.RequestWithCustomSender(j.Owner, &transfer.JobDone{ID: j.ID}, deps.Transfer)
	}
	ids := func(n, first int) []messages.BlockID {
		out := make([]messages.BlockID, n)
		for i := range out {
			out[i] = messages.BlockID(first + i)
		}
		return out
	}

	q := spawn("q", 4) // stores r's first part: the whole pool
	q(messages.Event{Type: messages.EvHashes, Hashes: hs[:4]}, messages.Event{Type: messages.EvBlocks, IDs: ids(4, 1)},
		messages.Event{Type: messages.EvTokens, Computed: 16, Total: 16}, messages.Event{Type: messages.EvFinished, Computed: 16, Total: 16})
	complete(testkit.Recv(t, seen, 5*time.Second, "q's job").(*transfer.Submit))
	testkit.Recv(t, released, 5*time.Second, "q released")

	r := spawn("r", 6)
	r(messages.Event{Type: messages.EvHashes, Hashes: hs}, messages.Event{Type: messages.EvBlocks, IDs: ids(6, 10)},
		messages.Event{Type: messages.EvTokens, Computed: 24, Total: 24}, messages.Event{Type: messages.EvFinished, Computed: 24, Total: 24})
	j := testkit.Recv(t, seen, 5*time.Second, "r's second part").(*transfer.Submit)
	var part []messages.ChunkIndex
	for _, c := range j.Chunks {
		part = append(part, c.Index)
	}
	require.Equal(t, []messages.ChunkIndex{4, 5}, part, "the first part was in the pool already")
	complete(j)
	var rel messages.Released
	require.NoError(t, json.Unmarshal(testkit.Recv(t, released, 5*time.Second, "r released").Data, &rel))
	require.Equal(t, messages.Released{Request: "r", Epoch: "a", RSeq: 2, Reason: messages.ReasonFinished}, rel)
	testkit.NoRecv(t, seen, 50*time.Millisecond, "a job after r's release")
}
