package client_test

import (
	"fmt"
	"math"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/ingest"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// TestARequestIDTheProtocolForbidsIsRefusedAtAdded: an id that is not
// UTF-8 (the wire would carry U+FFFD in its place, so the node's release
// would name another request) or over 256 bytes (the node rejects it) is
// refused by Added with ErrBadRequestID, and no event naming it is sent:
// the engine is told at the call instead of waiting for a release that
// never names it.
func TestARequestIDTheProtocolForbidsIsRefusedAtAdded(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	f := startFakeNode(t, nc, "n1", "boot1", testLease)
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec()})
	bad := []string{"r\xff", strings.Repeat("x", 257), ""}
	for _, id := range bad {
		require.ErrorIs(t, c.Added(id, 8), client.ErrBadRequestID, "id %q", id)
		require.ErrorIs(t, c.AddedMax(id, 8, 4), client.ErrBadRequestID, "id %q", id)
		c.Hashes(id, 0, []byte{1})
		c.Blocks(id, 0, 0, []uint32{1, 2})
		c.Tokens(id, 8, 8)
		c.Preempted(id)
		c.Resumed(id)
		c.Finished(id, false, 8, 8)
	}
	longest := strings.Repeat("é", 128) // 256 bytes
	require.NoError(t, c.Added(longest, 8))
	c.Finished(longest, false, 8, 8)
	require.NoError(t, c.Flush())
	epoch := c.Epoch()
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		evs := f.events(epoch)
		if len(evs) < 2 {
			return fmt.Errorf("the node applied %d events", len(evs))
		}
		for _, ev := range evs {
			if ev.Request != longest {
				return fmt.Errorf("an event naming %q was sent", ev.Request)
			}
		}
		// The node's release of the longest comes back on its own
		// delivery: awaited here, not read once the node has applied.
		if n := c.Stats().Awaiting; n != 0 {
			return fmt.Errorf("%d requests still await their release", n)
		}
		return nil
	})
	require.Equal(t, len(bad)*8, c.Stats().BadRequestIDs)
}

// TestACountTheProtocolForbidsIsRefusedAtItsEvent: a negative count or
// start, a group the spec lacks, a block id at or past the spec's
// num_gpu_blocks, or hashes or block ids past what its max_model_len lets
// a request hold, is refused by its event method with ErrOutOfRange. The
// node would reject the event (out_of_range, bad_group, block_range,
// too_large)
// and change nothing: a finished would never be released, and every
// resync would re-announce the bad value. So nothing of it is sent or
// mirrored: the node rejects no event the client sends, a refused finished
// owes no release, a resync re-announces none of them, and the same event
// with valid counts then works.
func TestACountTheProtocolForbidsIsRefusedAtItsEvent(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	f := startFakeNode(t, nc, "n1", "boot1", testLease)
	rel := newReleases()
	noRejects, before := nodeRejectsNothing(t)
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec(), OnReleased: rel.on,
		BeforePublish: before})
	require.NoError(t, c.Added("r", 8))
	refused := map[string]error{
		"added prompt_tokens":          c.Added("q", -1),
		"added_max prompt_tokens":      c.AddedMax("q", -1, 4),
		"added_max max_offload_tokens": c.AddedMax("q", 8, -1),
		"hashes start":                 c.Hashes("r", -1, []byte{1}),
		"blocks group -1":              c.Blocks("r", -1, 0, []uint32{1}),
		"blocks group 1 of 1":          c.Blocks("r", 1, 0, []uint32{1}),
		"blocks start":                 c.Blocks("r", 0, -1, []uint32{1}),
		"blocks id num_gpu_blocks":     c.Blocks("r", 0, 0, []uint32{1, 64}), // spec(): 64 GPU blocks
		"blocks id 2^32-1":             c.Blocks("r", 0, 0, []uint32{math.MaxUint32}),
		"hashes past max_model_len":    c.Hashes("r", 0, hashesOf(65)...), // spec(): 256 tokens, 64 hashes
		"blocks past max_model_len":    c.Blocks("r", 0, 0, make([]uint32, 65)),
		"tokens computed":              c.Tokens("r", -1, 8),
		"tokens total":                 c.Tokens("r", 8, -1),
		"finished computed":            c.Finished("r", false, -1, 8),
		"finished total":               c.Finished("r", true, 8, -1),
	}
	for what, err := range refused {
		require.ErrorIs(t, err, client.ErrOutOfRange, what)
	}
	st := c.Stats()
	require.Equal(t, len(refused), st.OutOfRange)
	require.Zero(t, st.Awaiting, "a refused finished is owed a release")
	require.Equal(t, 1, st.Live, "a refused added was mirrored")
	require.NoError(t, c.Flush())
	c.Resync() // re-announces the mirror: none of the refused events
	require.NoError(t, c.Flush())
	epoch := c.Epoch()
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		if evs := f.events(epoch); len(evs) != 1 || evs[0].Type != messages.EvAdded || evs[0].Request != "r" {
			return fmt.Errorf("the resync's epoch holds %+v, want r's added alone", evs)
		}
		return nil
	})
	require.NoError(t, c.Blocks("r", 0, 0, []uint32{1, 63}), "the last GPU block is an id")
	require.NoError(t, c.Hashes("r", 0, hashesOf(64)...), "64 hashes fit")
	require.NoError(t, c.Blocks("r", 0, 2, make([]uint32, 62)), "64 block ids fit")
	require.NoError(t, c.Tokens("r", 8, 8))
	require.NoError(t, c.Finished("r", false, 8, 8))
	require.NoError(t, c.Flush())
	require.Equal(t, "r", testkit.Recv(t, rel.ch, 5*time.Second, "r's release").Request)
	noRejects()
}

// nodeRejectsNothing returns a Config.BeforePublish that decodes each batch
// as the node does, and a check that the node rejected none of their
// events.
func nodeRejectsNothing(t *testing.T) (check func(), before func(*nats.Msg, uint64, int)) {
	var mu sync.Mutex
	var rejected []ingest.EventError
	before = func(m *nats.Msg, seq uint64, _ int) {
		_, evErrs, err := ingest.DecodeBatch("e1", m.Data, ingest.Limits{})
		if err != nil { // maybe on the client's goroutine: no FailNow
			t.Errorf("the node cannot decode batch %d: %v", seq, err)
		}
		mu.Lock()
		rejected = append(rejected, evErrs...)
		mu.Unlock()
	}
	return func() {
		t.Helper()
		mu.Lock()
		defer mu.Unlock()
		require.Empty(t, rejected, "the node rejects events the client sent")
	}, before
}

// TestAHashTheNodeRejectsIsRefusedAtHashes: an empty hash or one over 64
// bytes (the node's MaxHashBytes) is refused by Hashes with ErrBadHash,
// the whole event, before anything is recorded: the node would reject it
// bad_hash, so each later hashes event would be a hole and each resync
// would re-announce it. A 64-byte hash passes.
func TestAHashTheNodeRejectsIsRefusedAtHashes(t *testing.T) {
	t.Parallel()
	s, nc := testkit.NATS(t)
	f := startFakeNode(t, nc, "n1", "boot1", testLease)
	noRejects, before := nodeRejectsNothing(t)
	c := connect(t, dial(t, s.ClientURL(), "e1"), client.Config{Engine: "e1", Spec: spec(), BeforePublish: before})
	require.NoError(t, c.Added("r", 8))
	long, longest := make([]byte, 65), make([]byte, 64)
	longest[0] = 7
	require.ErrorIs(t, c.Hashes("r", 0, []byte{1}, long), client.ErrBadHash)
	require.ErrorIs(t, c.Hashes("r", 0, []byte{}), client.ErrBadHash)
	require.ErrorIs(t, c.Hashes("r", 0, []byte{1}, nil), client.ErrBadHash)
	require.Equal(t, 3, c.Stats().BadHashes)
	require.NoError(t, c.Hashes("r", 0, longest))
	require.NoError(t, c.Flush())
	c.Resync() // re-announces the mirror: the refused hashes are not in it
	require.NoError(t, c.Flush())
	epoch := c.Epoch()
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		evs := f.events(epoch)
		if len(evs) != 2 || evs[1].Type != messages.EvHashes || len(evs[1].Hashes) != 1 {
			return fmt.Errorf("the resync's epoch holds %+v, want r's added and one hash", evs)
		}
		return nil
	})
	noRejects()
}

// hashesOf is n distinct 8-byte hashes.
func hashesOf(n int) [][]byte {
	hs := make([][]byte, n)
	for i := range hs {
		hs[i] = []byte{byte(i), byte(i >> 8), 0, 0, 0, 0, 0, 1}
	}
	return hs
}
