package node

import (
	"sync"
	"time"
)

// Seams for the node_test package, compiled with the tests only.

// RecordLapse records a lapse now, as the watchdog does once no round trip
// has completed for 3/4 lease (transfer.Fence.Check at a time that far
// past the last one): a test with a long lease gets a lapse at a moment of
// its choosing, with no session tick near it.
func (n *Node) RecordLapse() { n.fence.Check(time.Now().Add(n.cfg.Lease)) }

// Ping makes one round trip with NATS as the pinger does; after a lapse it
// ends it.
func (n *Node) Ping() { n.ping() }

// HoldIntake stops the intake's take before it stamps a message with the
// fence generation (the lock its stop takes), as a descheduled NATS
// subscription goroutine would, until release.
func (n *Node) HoldIntake() (release func()) {
	n.ingest.gate.Lock()
	return sync.OnceFunc(n.ingest.gate.Unlock)
}

// HoldKVJournal holds the kv_events journal's lock until release: whoever
// adds to it meanwhile (the disk tier announcing a change, under its own
// lock) waits.
func (n *Node) HoldKVJournal() (release func()) {
	n.kv.mu.Lock()
	return sync.OnceFunc(n.kv.mu.Unlock)
}

// WithClock sets the node's liveness clock (Config.now): engine expiry and
// the engine-silence fence read it.
func WithClock(now func() time.Time) func(*Config) {
	return func(c *Config) { c.now = now }
}
