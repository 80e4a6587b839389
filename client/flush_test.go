package client_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// TestALargeStepGoesOutInSeveralBatches: a step announcing more than NATS'
// max_payload (1 MiB here: the hashes of a long prompt and its blocks) is
// split by MaxBatchBytes into batches of consecutive seqs, a long hashes
// or blocks event into events by start, instead of being refused by NATS
// and becoming a resync of every request. The node applies all of it, in
// order, in the same epoch.
func TestALargeStepGoesOutInSeveralBatches(t *testing.T) {
	s, nc := testkit.NATS(t)
	// A long lease: the fake node takes heartbeats on another goroutine
	// than batches, so one overtaking a slowly decoded batch would read as
	// a lost tail (a real node handles them in order).
	f := startFakeNode(t, nc, "n1", "boot1", time.Minute)
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec()})
	c.Added("other", 8)
	require.NoError(t, c.Flush())
	epoch := c.Epoch()
	const n = 20000 // 20000 hashes of 32 bytes: about 1.3 MB of hex
	hs := make([][]byte, n)
	ids := make([]uint32, n)
	for i := range hs {
		hs[i] = make([]byte, 32)
		hs[i][0], hs[i][1] = byte(i), byte(i>>8)
		ids[i] = 4000000000 + uint32(i) // 10 digits each
	}
	c.Added("long", 4*n)
	c.Hashes("long", 0, hs...)
	c.Blocks("long", 0, 0, ids)
	c.Tokens("long", 4*n, 4*n)
	require.NoError(t, c.Flush())

	testkit.Eventually(t, 10*time.Second, 10*time.Millisecond, func() error {
		var hashes, blocks int
		tokens := false
		for _, ev := range f.events(epoch) {
			if ev.Request != "long" {
				continue
			}
			switch ev.Type {
			case messages.EvHashes:
				if ev.Start != hashes {
					return fmt.Errorf("hashes from %d after %d", ev.Start, hashes)
				}
				hashes += len(ev.Hashes)
			case messages.EvBlocks:
				if ev.Start != blocks {
					return fmt.Errorf("blocks from %d after %d", ev.Start, blocks)
				}
				blocks += len(ev.IDs)
			case messages.EvTokens:
				tokens = hashes == n && blocks == n
			}
		}
		if !tokens {
			return fmt.Errorf("the node applied %d hashes, %d blocks, no tokens after them", hashes, blocks)
		}
		return nil
	})
	st := c.Stats()
	require.Zero(t, st.PublishErrors, "a batch was refused by NATS")
	require.Empty(t, st.Resyncs)
	require.Equal(t, epoch, c.Epoch())
	require.Greater(t, st.Batches, 4)
}
