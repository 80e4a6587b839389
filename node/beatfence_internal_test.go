package node

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvactors/kvactors/actors/transfer"
)

// A round trip counts for the fence no later than the last heartbeat's
// publish plus its period: an engine counts its lease from the last node
// message it heard, so a heartbeat overdue must age the fence as a round
// trip overdue does.
func TestARoundTripCountsNoLaterThanTheLastHeartbeatsPeriod(t *testing.T) {
	const lease = time.Hour // the node's own loops stay out of the way
	n, _, _ := startInternal(t, func(c *Config) { c.Lease = lease })
	var clock atomic.Pointer[time.Time]
	longAgo := time.Now().Add(-lease)
	clock.Store(&longAgo)
	n.fence = transfer.NewFence(lease, func() time.Time { return *clock.Load() }, nil) // its last round trip: a lease ago
	now := time.Now()
	clock.Store(&now)

	n.lastBeat.Store(&longAgo) // and the last heartbeat too
	if err := n.ping(); err != nil {
		t.Fatal(err)
	}
	if !n.Fenced() {
		t.Fatal("a round trip after a lease of no heartbeat counted as fresh")
	}
	beat := time.Now()
	n.lastBeat.Store(&beat)
	if err := n.ping(); err != nil {
		t.Fatal(err)
	}
	if n.Fenced() {
		t.Fatal("a round trip just after a heartbeat not counted")
	}
}

// A heartbeat that does not go out (the outbox sealed at shutdown, a
// refused publish) leaves the fence counting from the last one that did:
// no engine heard it.
func TestAHeartbeatThatDidNotGoOutIsNotCounted(t *testing.T) {
	n, _, _ := startInternal(t, func(c *Config) { c.Lease = time.Hour })
	old := time.Now().Add(-time.Minute)
	n.lastBeat.Store(&old)
	n.beat()
	if got := n.lastBeat.Load(); got == nil || !got.After(old) {
		t.Fatal("a heartbeat that went out not counted")
	}
	n.lastBeat.Store(&old)
	n.outbox.Seal(func() int64 { return 0 })
	n.beat()
	if got := n.lastBeat.Load(); got == nil || !got.Equal(old) {
		t.Fatalf("a heartbeat that did not go out counted: last beat %v, want %v", got, old)
	}
}
