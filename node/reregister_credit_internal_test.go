package node

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/internal/testkit"
)

// A register that replaces an engine's actor (a new spec) leaves the
// batches the old actor has not handled counted in the intake budget until
// it handles them: they still wait in its mailbox, decoded, in memory.
// Given back at the re-register, each one could let a whole budget more in
// (--max-pending-bytes). The old actor is held inside a turn (a Tick's,
// which reads the fence generation) on the test's goroutine, not the
// intake worker's (its mailbox runs on the sender's), while its batches
// queue behind it.
func TestAReplacedActorsBatchesStayCountedUntilItHandlesThem(t *testing.T) {
	t.Parallel()
	n, nc, dir := startInternal(t, nil)
	h := registerHeldEngine(t, n, nc, dir, "e1")

	h.arm.Store(true)
	go n.system.Root.Send(n.engine("e1").pid, &engine.Tick{})
	testkit.Recv(t, h.holding, 5*time.Second, "the old actor held in a turn")
	subject := "kvactors.e1.events"
	var want int64
	for seq := 1; seq <= 3; seq++ {
		data := []byte(fmt.Sprintf(`{"epoch":"a","seq":%d,"events":[]}`, seq))
		want += creditOf(t, n, "e1", subject, data) // decoded by the worker, held by the actor
		require.NoError(t, nc.Publish(subject, data))
	}
	require.NoError(t, nc.Flush())
	pendingIs := func(want int64) func() error {
		return func() error {
			if got := n.ingest.pending.Load(); got != want {
				return fmt.Errorf("intake counts %d bytes, want %d", got, want)
			}
			return nil
		}
	}
	testkit.Eventually(t, 5*time.Second, time.Millisecond, pendingIs(want)) // all three handed to the old actor

	registerOneEngine(t, nc, dir, "e1") // a new segment: a new spec, a new actor
	testkit.Eventually(t, 2*time.Second, time.Millisecond, pendingIs(want))
	require.Equal(t, want, n.ingest.pending.Load(), "the old actor's batches still count")

	h.release() // the old actor handles its batches, then its retire
	testkit.Eventually(t, 5*time.Second, time.Millisecond, pendingIs(0))
}

// heldEngine is an engine actor whose next turn that reads its fence
// generation (Deps.Session: a batch's or a Tick's) can be held: arm it,
// cause the turn, receive from holding; release lets it go (also at the
// test's end, so a failed test leaves the goroutine free).
type heldEngine struct {
	arm     atomic.Bool
	holding chan struct{}
	release func()
}

// registerHeldEngine registers engine id with an actor whose turn can be
// held (heldEngine); the engine's next actors are not.
func registerHeldEngine(t *testing.T, n *Node, nc *nats.Conn, dir, id string) *heldEngine {
	t.Helper()
	h := &heldEngine{holding: make(chan struct{}, 1)}
	gate := make(chan struct{})
	var letGo sync.Once
	h.release = func() { letGo.Do(func() { close(gate) }) }
	t.Cleanup(h.release)
	n.mu.Lock()
	n.editEngine = func(d *engine.Deps) {
		gen := d.Session
		d.Session = func() uint64 {
			if h.arm.CompareAndSwap(true, false) {
				h.holding <- struct{}{}
				<-gate
			}
			return gen()
		}
	}
	n.mu.Unlock()
	registerOneEngine(t, nc, dir, id)
	n.mu.Lock()
	n.editEngine = nil
	n.mu.Unlock()
	return h
}
