package engine_test

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// The engine's next actor (a re-register) takes in the epochs its earlier
// actor began (Deps.Epochs): a batch of the earlier actor's live epoch a
// that arrives late, after the engine began b with the new actor, is
// stale there too. Before, the new actor took a for a new epoch: it reset
// b's requests, ordered a resync of a (which the engine, having left a,
// ignores), and dropped every later batch of b as stale, with no order
// naming b: the engine talked to a wall.
func TestALateBatchOfThePredecessorsEpochDoesNotEndTheLiveOne(t *testing.T) {
	_, nc := testkit.NATS(t)
	resyncs := testkit.Subscribe(t, nc, "kvactors.e1.resync")
	trail, system, pid := successorOfEpochA(t, nc)
	require.Equal(t, []string{"a"}, trail.Recent())
	send := epochSender(system, pid)
	send("b", 1, added("live"))
	send("a", 2, tokens("old", 4)) // sent in a before b began, arriving after
	send("b", 2, tokens("live", 4))
	send("b", 3, tokens("live", 8))
	st := statusOf(t, system, pid)
	require.Equal(t, "b", st.Epoch)
	require.Equal(t, uint64(3), st.Seq, "b's batches applied")
	require.False(t, st.Resyncing)
	require.Len(t, st.Requests, 1)
	require.Equal(t, "live", st.Requests[0].Request)
	require.Equal(t, 8, st.Requests[0].Computed)
	require.NoError(t, nc.Flush())
	testkit.NoRecv(t, resyncs, 50*time.Millisecond, "a resync")
	require.Equal(t, []string{"b", "a"}, trail.Recent())
}

// An engine may go on with its epoch after registering again: the next
// actor takes the earlier one's live epoch as an unseen one, its seq past 1
// a gap, resynced (the engine then begins a new epoch), not stale.
func TestThePredecessorsLiveEpochGoingOnIsResynced(t *testing.T) {
	_, nc := testkit.NATS(t)
	resyncs := testkit.Subscribe(t, nc, "kvactors.e1.resync")
	_, system, pid := successorOfEpochA(t, nc)
	epochSender(system, pid)("a", 2, tokens("old", 4))
	var rs messages.Resync
	require.NoError(t, json.Unmarshal(testkit.Recv(t, resyncs, 5*time.Second, "the resync of a").Data, &rs))
	require.Equal(t, "a", rs.Epoch)
	require.Equal(t, uint64(1), rs.Expected)
	require.Equal(t, uint64(2), rs.Got)
}

// successorOfEpochA starts an engine actor that begins epoch "a" (request
// "old"), then the engine's next actor sharing its EpochTrail, as a
// re-register makes it; it returns the trail and the next actor.
func successorOfEpochA(t *testing.T, nc *nats.Conn) (*engine.EpochTrail, *actor.ActorSystem, *actor.PID) {
	t.Helper()
	trail := &engine.EpochTrail{}
	withTrail := func(d *engine.Deps) { d.Epochs = trail }
	first, firstPID, _ := startSubmitting(t, nc, withTrail)
	epochSender(first, firstPID)("a", 1, added("old"))
	require.Equal(t, "a", statusOf(t, first, firstPID).Epoch)
	system, pid, _ := startSubmitting(t, nc, withTrail)
	return trail, system, pid
}
