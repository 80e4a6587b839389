package node

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

// An engine parked behind its register's claim (claimStep) is backlogged
// at its lease check though the marks show its messages handled (they
// wait behind the claim, unseen by its actor); another engine of the same
// shard is not.
func TestALeaseCheckSeesAnEngineParkedBehindItsClaim(t *testing.T) {
	in := &ingester{queues: []chan inbound{make(chan inbound, 4), make(chan inbound, 4)},
		marks: make([]shardMarks, 2)}
	s := in.shard("e1")
	other := "e2"
	for i := 3; in.shard(other) != s; i++ {
		other = fmt.Sprintf("e%d", i)
	}
	mk := &in.marks[s]
	mk.queuing(1)
	in.queues[s] <- inbound{engine: "e1", n: 1}
	mk.sent(1, true)
	x := <-in.queues[s]
	mk.park("e1", true) // the worker parks it (a register), then marks it handled
	mk.handled.Store(x.n)
	require.True(t, in.backlogged("e1"), "parked behind its claim")
	require.False(t, in.backlogged(other), "another engine of the shard")
	mk.park("e1", false) // its claim done, its messages handled
	require.False(t, in.backlogged("e1"))
}

// A register's claim that begins after the intake stopped (a register still
// queued at Close) is not made: Close would otherwise answer it OK and then
// retire the engine it had just claimed. context.AfterFunc cancels the
// claim's context on a goroutine of its own, too late for a Resolve that
// starts at once, so claimRegister looks at halt itself.
func TestAClaimBegunAfterTheIntakeStoppedIsNotMade(t *testing.T) {
	c := &clusterNode{} // no owners bucket: a claim made would fail the test by reaching it
	n := &Node{cl: c, cfg: Config{Lease: time.Second}}
	began := false
	f := func(context.Context, string) { began = true }
	c.onClaim.Store(&f)
	halt, stop := context.WithCancel(context.Background())
	stop() // the intake stopped
	require.False(t, n.claimRegister(context.Background(), halt, "e1", messages.EngineSpec{}, ""))
	require.False(t, began, "no claim begun")
}
