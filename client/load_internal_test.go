package client

import (
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A node given up for lost settles only the loads known to have reached
// NATS: one whose flush never came back may still sit in the connection's
// reconnect buffer (the engine's own link dropped) and reach a node that is
// alive after all, whose fence never closed. Its reply or an answered
// unregister (sent after it on the same connection) still settles it.
func TestNodeLossSettlesOnlyLoadsThatReachedNATS(t *testing.T) {
	t.Parallel()
	c := &Client{loads: map[*loadWait]struct{}{}}
	load := func(atServer bool) *loadWait {
		w := &loadWait{node: "n1", boot: "b1", settled: make(chan struct{}), doubt: true, atServer: atServer}
		c.loads[w] = struct{}{}
		c.st.LoadsInDoubt++
		return w
	}
	settled := func(w *loadWait) bool {
		select {
		case <-w.settled:
			return true
		default:
			return false
		}
	}
	reached, buffered, elsewhere := load(true), load(false), load(true)
	elsewhere.node = "n2"

	c.settleLoadsOfLocked("n1", "b1", true) // n1 lost past its lease
	require.True(t, settled(reached), "a load at NATS is covered by the lost node's fence")
	require.False(t, settled(buffered), "a load that may be in the reconnect buffer stays in doubt")
	require.False(t, settled(elsewhere), "another node's load is not this loss's business")
	require.Equal(t, 2, c.st.LoadsInDoubt)

	c.settleLoadsOfLocked("n1", "b1", false) // n1 answered the unregister
	require.True(t, settled(buffered))
	require.False(t, settled(elsewhere))
	require.Equal(t, 1, c.st.LoadsInDoubt)
}

// Another boot of the node proves its old process can copy nothing any
// more: at the loss's free, every load of the old boot is settled, also one
// whose request may still have been in the reconnect buffer (the node's
// crash took the engine's link, as with its embedded NATS server).
func TestANewBootSettlesEveryLoadOfTheOldOne(t *testing.T) {
	t.Parallel()
	c := &Client{loads: map[*loadWait]struct{}{}, node: "n1", boot: "b1", lease: time.Second,
		cfg: Config{Log: slog.New(slog.NewTextHandler(io.Discard, nil))}}
	w := &loadWait{node: "n1", boot: "b1", settled: make(chan struct{}), doubt: true}
	c.loads[w] = struct{}{}
	c.st.LoadsInDoubt++
	c.lastSeen = time.Now().Add(-2 * time.Second)
	c.seenLocked("n1", "b2") // n1's hello from its next process: a suspicion only
	require.False(t, c.lost)
	c.repliedLocked("n1", "b2", c.probeLocked()) // b2 answers a probe: the proof
	require.True(t, c.lost)
	c.freeLossLocked()
	select {
	case <-w.settled:
	default:
		t.Fatal("a load of the old boot stayed in doubt after the node restarted")
	}
	require.Zero(t, c.st.LoadsInDoubt)
}
