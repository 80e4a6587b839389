package node

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// An engine's load gate waits for the loads in flight and lets none in once
// the engine is ending: a load taken just before an expiry detaches the
// engine must either be waited for or refused, never copy into segments
// being unmapped.
func TestLoadGateRefusesLoadsOnceEnding(t *testing.T) {
	var g loadGate
	require.True(t, g.enter(), "a live engine takes loads")
	waited := make(chan struct{})
	go func() {
		g.closeAndWait()
		close(waited)
	}()
	// The closer marks the gate before it waits: once it has, enter fails.
	deadline := time.After(5 * time.Second)
	for g.enter() {
		g.leave() // let in before the close: in flight, so leave it again
		select {
		case <-deadline:
			t.Fatal("enter still succeeds after closeAndWait began")
		case <-waited:
			t.Fatal("closeAndWait returned with a load in flight")
		default:
		}
	}
	select {
	case <-waited:
		t.Fatal("closeAndWait returned with a load in flight")
	case <-time.After(20 * time.Millisecond): // no event to wait on: the wait must not end by itself
	}
	g.leave()
	select {
	case <-waited:
	case <-time.After(5 * time.Second):
		t.Fatal("closeAndWait did not return once the last load left")
	}
	require.False(t, g.enter(), "an ended engine takes no load")
}
