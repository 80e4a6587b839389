package client_test

import (
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
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
	t.Parallel()
	s, nc := testkit.NATS(t)
	// A long lease: the fake node takes heartbeats on another goroutine
	// than batches, so one overtaking a slowly decoded batch would read as
	// a lost tail (a real node handles them in order).
	f := startFakeNode(t, nc, "n1", "boot1", time.Minute)
	const n = 20000            // 20000 hashes of 32 bytes: about 1.3 MB of hex
	const firstID = 2000000000 // ten digits each; the spec must hold them (≤ 2^31 blocks)
	sp := spec()
	sp.NumGPUBlocks = firstID + n
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: sp})
	c.Added("other", 8)
	require.NoError(t, c.Flush())
	epoch := c.Epoch()
	hs := make([][]byte, n)
	ids := make([]uint32, n)
	for i := range hs {
		hs[i] = make([]byte, 32)
		hs[i][0], hs[i][1] = byte(i), byte(i>>8)
		ids[i] = firstID + uint32(i)
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

// A step's batch that is nearly full when a long Blocks event comes goes
// out before the event's first part of ids, so no part is much larger than
// MaxBatchBytes (appended to the nearly full batch, that part would be up
// to twice it: with MaxBatchBytes 600 KiB, past NATS' 1 MiB max_payload,
// refused, and a resync).
func TestABlocksEventCutNeverTakesAStepPartPastTheBound(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	startFakeNode(t, nc, "n1", "boot1", time.Minute)
	const maxBatch = 600 << 10
	var mu sync.Mutex
	largest := 0
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec(), MaxBatchBytes: maxBatch,
		BeforePublish: func(m *nats.Msg, seq uint64, events int) {
			mu.Lock()
			largest = max(largest, len(m.Data))
			mu.Unlock()
		}})
	// 9100 hashes of 32 bytes: ~610 KB of events, just under 600 KiB.
	const nh = 9100
	hs := make([][]byte, nh)
	for i := range hs {
		hs[i] = make([]byte, 32)
		hs[i][0], hs[i][1] = byte(i), byte(i>>8)
	}
	const nb = 60000
	ids := make([]uint32, nb)
	for i := range ids {
		ids[i] = 4000000000 + uint32(i)
	}
	require.NoError(t, c.Added("long", 4*nb))
	c.Hashes("long", 0, hs...)
	c.Blocks("long", 0, 0, ids)
	require.NoError(t, c.Flush())
	st := c.Stats()
	mu.Lock()
	defer mu.Unlock()
	require.LessOrEqual(t, largest, maxBatch+4096, "a part of the step past MaxBatchBytes")
	require.Zero(t, st.PublishErrors, "a part of the split step was refused by NATS (over max_payload)")
	require.Empty(t, st.Resyncs)
}

// TestAResyncGoesOutInBatchesOfMaxBatchBytes: a resync re-announces every
// live request in batches cut at MaxBatchBytes (by the batch's own size,
// wire.Batch.Len), each over it by at most one event, and the node applies
// all of it in the new epoch.
func TestAResyncGoesOutInBatchesOfMaxBatchBytes(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	f := startFakeNode(t, nc, "n1", "boot1", time.Minute)
	const maxBatch = 4096
	var mu sync.Mutex
	dropped := false
	sizes := map[string][]int{} // epoch -> size of each batch
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec(), MaxBatchBytes: maxBatch,
		DropBatch: func(seq uint64) bool { // the first epoch's seq 2: a gap, so the node asks for a resync
			mu.Lock()
			defer mu.Unlock()
			drop := seq == 2 && !dropped
			dropped = dropped || drop
			return drop
		},
		BeforePublish: func(m *nats.Msg, seq uint64, events int) {
			epoch := batchEpoch(m)
			mu.Lock()
			sizes[epoch] = append(sizes[epoch], len(m.Data))
			mu.Unlock()
		}})
	first := c.Epoch()
	const reqs, perReq = 50, 20 // 20 hashes of 32 bytes: about 1.4 KB each
	addWithHashes(t, c, reqs, perReq)
	require.NoError(t, c.Flush())
	awaitResyncedHashes(t, c, f, first, reqs*perReq)
	mu.Lock()
	defer mu.Unlock()
	resent := sizes[c.Epoch()]
	require.Greater(t, len(resent), 10, "the re-announcement in batches of MaxBatchBytes")
	for _, n := range resent {
		require.LessOrEqual(t, n, maxBatch+2048, "a resync batch past MaxBatchBytes by more than one event")
	}
	require.Zero(t, c.Stats().PublishErrors)
}

// TestAResyncSendsNothingAfterABatchThatFailed: when one batch of a resync
// cannot be published, none after it is (they would follow a gap the node
// never fills; PROTOCOL.md checklist step 9), and the next resync, in yet
// another epoch, re-announces everything.
func TestAResyncSendsNothingAfterABatchThatFailed(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	f := startFakeNode(t, nc, "n1", "boot1", time.Minute)
	const failAt = 3
	var mu sync.Mutex
	var first, failed string          // the first epoch; the one whose batch failAt failed
	attempts := map[string][]uint64{} // epoch -> seqs the client tried to publish
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec(), MaxBatchBytes: 4096,
		BeforePublish: func(m *nats.Msg, seq uint64, events int) {
			epoch := batchEpoch(m)
			mu.Lock()
			defer mu.Unlock()
			attempts[epoch] = append(attempts[epoch], seq)
			if epoch != first && failed == "" && seq == failAt {
				failed = epoch
				m.Subject = "" // NATS refuses it (ErrBadSubject), as a publish while reconnecting
			}
		}})
	mu.Lock()
	first = c.Epoch()
	mu.Unlock()
	const reqs, perReq = 50, 20 // about 70 KB: some 17 batches of 4 KiB
	addWithHashes(t, c, reqs, perReq)
	require.NoError(t, c.Flush())
	c.Resync()
	require.NoError(t, c.Flush()) // the resync runs here, under the client's lock

	mu.Lock()
	require.NotEmpty(t, failed, "no resync batch failed")
	require.Equal(t, []uint64{1, 2, failAt}, attempts[failed], "batches tried in the resync epoch after the failed one")
	mu.Unlock()
	awaitResyncedHashes(t, c, f, failed, reqs*perReq)
	st := c.Stats()
	require.Equal(t, 1, st.PublishErrors)
	require.Equal(t, 1, st.Resyncs[client.ResyncRetry])
}

// batchEpoch is the epoch of an event batch the client publishes ("" if
// its body does not say).
func batchEpoch(m *nats.Msg) string {
	var b struct{ Epoch string }
	_ = json.Unmarshal(m.Data, &b)
	return b.Epoch
}

// awaitResyncedHashes flushes until c has left epoch old and the node f
// applied want hashes in c's new epoch (a resync's re-announcement).
func awaitResyncedHashes(t *testing.T, c *client.Client, f *fakeNode, old string, want int) {
	t.Helper()
	testkit.Eventually(t, 10*time.Second, 10*time.Millisecond, func() error {
		require.NoError(t, c.Flush())
		if c.Epoch() == old {
			return fmt.Errorf("still in epoch %s: no resync yet", old)
		}
		hashes := 0
		for _, ev := range f.events(c.Epoch()) {
			hashes += len(ev.Hashes)
		}
		if hashes != want {
			return fmt.Errorf("the node applied %d hashes in epoch %s, want %d", hashes, c.Epoch(), want)
		}
		return nil
	})
}

// addWithHashes announces reqs requests r0, r1, … with perReq distinct
// 32-byte hashes each.
func addWithHashes(t *testing.T, c *client.Client, reqs, perReq int) {
	t.Helper()
	for i := range reqs {
		hs := make([][]byte, perReq)
		for j := range hs {
			hs[j] = make([]byte, 32)
			hs[j][0], hs[j][1] = byte(i), byte(j)
		}
		id := fmt.Sprintf("r%d", i)
		require.NoError(t, c.Added(id, 4*perReq))
		require.NoError(t, c.Hashes(id, 0, hs...))
	}
}

// TestAStepSendsNothingAfterAPartThatFailed: a step over MaxBatchBytes goes
// out as several batches; once one cannot be published, none after it is
// (each would follow a gap: checklist step 9), and a resync is due.
func TestAStepSendsNothingAfterAPartThatFailed(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	startFakeNode(t, nc, "n1", "boot1", time.Minute)
	const failAt = 2
	var mu sync.Mutex
	var first string
	var tried []uint64 // seqs the client tried to publish in the first epoch
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec(), MaxBatchBytes: 4096,
		BeforePublish: func(m *nats.Msg, seq uint64, events int) {
			mu.Lock()
			defer mu.Unlock()
			if batchEpoch(m) == first {
				tried = append(tried, seq)
				if seq == failAt {
					m.Subject = "" // NATS refuses it (ErrBadSubject), as a publish while reconnecting
				}
			}
		}})
	mu.Lock()
	first = c.Epoch()
	mu.Unlock()
	addWithHashes(t, c, 50, 20) // about 70 KB: some 17 parts of 4 KiB
	require.NoError(t, c.Flush())
	mu.Lock()
	require.Equal(t, []uint64{1, failAt}, tried, "parts tried after the failed one")
	mu.Unlock()
	require.Equal(t, 1, c.Stats().PublishErrors)
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		require.NoError(t, c.Flush()) // a resync due starts at the next Flush, or the session loop's tick
		if n := c.Stats().Resyncs[client.ResyncPublishError]; n != 1 {
			return fmt.Errorf("%d publish_error resyncs", n)
		}
		return nil
	})
}
