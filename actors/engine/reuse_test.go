package engine_test

import (
	"encoding/json"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// A released request's actor serves a later request instead of being
// stopped, up to a bound of idle ones; every request is still released
// once, with its own id. Spawns are counted by the process registry's id
// sequence (one id per unnamed spawn).
func TestReleasedRequestActorsServeLaterRequests(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	closed := make(chan struct{})
	system, pid, _, _ := startEngine(t, nc, closed, nil) // nothing stored: no pool needed
	seq := uint64(0)
	send := func(evs ...messages.Event) {
		seq++
		sendBatch(system, pid, seq, evs...)
	}
	expect := func(ids ...string) {
		t.Helper()
		want := map[string]bool{}
		for _, id := range ids {
			want[id] = true
		}
		for range ids {
			var rel messages.Released
			require.NoError(t, json.Unmarshal(testkit.Recv(t, released, 5*time.Second, "a release").Data, &rel))
			require.True(t, want[rel.Request], "release of %q: unexpected or twice", rel.Request)
			delete(want, rel.Request)
			require.Equal(t, "finished", rel.Reason)
		}
	}
	spawned := func() uint64 { return atomic.LoadUint64(&system.ProcessRegistry.SequenceID) }

	// One request at a time: after the first, each reuses the one actor.
	send(added("s0"), finished("s0"))
	expect("s0")
	base := spawned()
	for i := 1; i <= 50; i++ {
		id := fmt.Sprintf("s%d", i)
		send(added(id), tokens(id, 4), finished(id))
		expect(id)
	}
	// An engine may reuse a request id as soon as it reads the release:
	// each reuse is a new request, released once.
	for range 20 {
		send(added("same"), tokens("same", 4), finished("same"))
		expect("same")
	}
	// The engine takes each Done after the release it follows: a status
	// query (answered by a spawned collector) comes after the last one. A
	// request actor sends its Done just after it publishes its release, so
	// the next request, sent as soon as the release is read, can now and
	// then reach the engine first and find no idle actor yet: a few spawns
	// of 70 (without reuse, every request would spawn one).
	require.Empty(t, requestsOf(t, system, pid))
	require.LessOrEqual(t, spawned(), base+1+3, "70 requests in turn took no more than a few new actors (and the status collector one)")
	// Each of those spawns left one more actor idle: s0's and every new
	// one since (the collector's spawn stands in for s0's in the count).
	idle := spawned() - base

	// MaxIdle+36 at once, released together: MaxIdle wait idle, the rest
	// stop; the next wave takes the MaxIdle and spawns 36.
	n := request.MaxIdle + 36
	wave := func(tag string) {
		ids := make([]string, n)
		var adds, ends []messages.Event
		for i := range ids {
			ids[i] = fmt.Sprintf("%s%d", tag, i)
			adds = append(adds, added(ids[i]), tokens(ids[i], 4))
			ends = append(ends, finished(ids[i]))
		}
		send(adds...)
		require.Len(t, requestsOf(t, system, pid), n)
		send(ends...)
		expect(ids...)
		require.Empty(t, requestsOf(t, system, pid))
	}
	before := spawned()
	wave("a")
	afterA := spawned()
	require.Equal(t, uint64(n)-idle+2, afterA-before, "all new but the idle actors, and two status collectors")
	wave("b")
	require.Equal(t, uint64(36+2), spawned()-afterA, "MaxIdle reused, 36 new, two status collectors")

	system.Root.Send(pid, &engine.Retire{})
	select { // closed, not sent on
	case <-closed:
	case <-time.After(5 * time.Second):
		t.Fatal("the engine did not stop with idle children")
	}
}

// An idle actor that stops (it failed, or something stopped it) is never
// given a request: the engine forgets it on Terminated, and the next
// request gets a new actor and is released. Were the dead pid reused, the
// request's events would go to dead letters and its engine would wait for
// its release for ever.
func TestAStoppedIdleActorIsNotReused(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	system, pid, _, _ := startEngine(t, nc, make(chan struct{}), nil)
	sendBatch(system, pid, 1, added("r0"), finished("r0"))
	testkit.Recv(t, released, 5*time.Second, "r0 released")

	// The engine's only child now is r0's actor (no status gather yet).
	var children []*actor.PID
	for _, bucket := range system.ProcessRegistry.LocalPIDs.LocalPIDs {
		for _, id := range bucket.Keys() {
			if strings.HasPrefix(id, pid.Id+"/") {
				children = append(children, actor.NewPID(system.ProcessRegistry.Address, id))
			}
		}
	}
	require.Len(t, children, 1)
	idle := func(want int) func() error {
		return func() error {
			if st := statusOf(t, system, pid); st.IdleActors != want {
				return fmt.Errorf("%d idle actors, want %d", st.IdleActors, want)
			}
			return nil
		}
	}
	testkit.Eventually(t, 5*time.Second, time.Millisecond, idle(1))

	require.NoError(t, system.Root.StopFuture(children[0]).Wait())
	testkit.Eventually(t, 5*time.Second, time.Millisecond, idle(0))

	sendBatch(system, pid, 2, added("r1"), tokens("r1", 4), finished("r1"))
	var rel messages.Released
	require.NoError(t, json.Unmarshal(testkit.Recv(t, released, 5*time.Second, "r1 released").Data, &rel))
	require.Equal(t, "r1", rel.Request)
}
