package engine_test

import (
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// A release the engine actor holds back (a finished for a request it never
// knew, while a predecessor still ends) is owed until it goes out: a
// shutdown sealed meanwhile (its timeout past, Node.Close seals with the
// owed count) counts it undelivered; it was left out, and Close could
// report nothing undelivered while an engine waited for it.
func TestASealedShutdownCountsAHeldBackReleaseUndelivered(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	predecessor, closed := make(chan struct{}), make(chan struct{})
	var owed atomic.Int64
	var out *actors.Outbox
	system, pid, _ := startSubmitting(t, nc, func(d *engine.Deps) {
		d.Predecessors = []<-chan struct{}{predecessor}
		d.Closed = closed
		d.Request.Owed = &owed
		out = d.Outbox
	})
	epochSender(system, pid)("b", 1, messages.Event{Type: messages.EvFinished, Request: "u", Computed: 4, Total: 4})
	statusOf(t, system, pid)
	system.Root.Send(pid, &engine.Retire{Reason: messages.ReasonEngineGone})
	testkit.NoRecv(t, released, 100*time.Millisecond, "u's held-back release while the predecessor still ends")
	undelivered := out.Seal(owed.Load)
	close(predecessor)
	testkit.Closed(t, closed, 5*time.Second, "the actor stopped")
	testkit.NoRecv(t, released, 100*time.Millisecond, "u's release after the seal")
	require.Equal(t, int64(1), undelivered, "the held-back release, never published, is not counted undelivered")
	require.Equal(t, int64(1), owed.Load(), "it stays owed")
}

// Published once the predecessor has ended, the held-back release is owed
// no more.
func TestAHeldBackReleaseIsOwedUntilItGoesOut(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	predecessor := make(chan struct{})
	var owed atomic.Int64
	system, pid, _ := startSubmitting(t, nc, func(d *engine.Deps) {
		d.Predecessors = []<-chan struct{}{predecessor}
		d.Request.Owed = &owed
	})
	epochSender(system, pid)("b", 1, messages.Event{Type: messages.EvFinished, Request: "u", Computed: 4, Total: 4})
	statusOf(t, system, pid)
	require.Equal(t, int64(1), owed.Load(), "held back: owed")
	close(predecessor)
	testkit.Recv(t, released, 5*time.Second, "u's release once the predecessor ended")
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if n := owed.Load(); n != 0 {
			return fmt.Errorf("owed %d after the release went out", n)
		}
		return nil
	})
}
