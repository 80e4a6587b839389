package node_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// loadInto loads the first tokens of a hash prefix into blocks (one list per
// group) and returns the reply.
func (te *testEngine) loadInto(req string, hashes []string, tokens int, blocks ...[]int) messages.LoadReply {
	te.e.t.Helper()
	var r messages.LoadReply
	require.NoError(te.e.t, json.Unmarshal(te.request("load", map[string]any{"request": req, "hashes": hashes,
		"num_tokens": tokens, "blocks": blocks}), &r))
	return r
}

func (te *testEngine) lookup(hashes []string) int {
	te.e.t.Helper()
	got, err := te.tryLookup(hashes, 5*time.Second)
	require.NoError(te.e.t, err)
	return got
}

// tryLookup is lookup for a retry loop: a timeout (a NATS server of a
// cluster just stopped) or an error reply is returned, not fatal.
func (te *testEngine) tryLookup(hashes []string, timeout time.Duration) (int, error) {
	data, err := json.Marshal(map[string]any{"hashes": hashes})
	if err != nil {
		return 0, err
	}
	msg, err := testkit.EngineRequest(te.e.nc, te.id, "kvactors."+te.id+".lookup", data, timeout)
	if err != nil {
		return 0, fmt.Errorf("lookup: %w", err)
	}
	var r messages.LookupReply
	if err := json.Unmarshal(msg.Data, &r); err != nil {
		return 0, err
	}
	if r.Error != "" {
		return 0, fmt.Errorf("lookup: %s", r.Error)
	}
	return r.HitTokens, nil
}

// keepAlive makes te heard by its node until the test ends, as a real
// engine's heartbeats do: a lookup every period (a lookup counts as the
// engine's message, unlike status, and changes nothing; a heartbeat would
// race the test's sends for te.seq). A load after lease/2 or more of
// silence is refused (PROTOCOL.md "Engine silence"), so a test whose engine
// waits on other nodes before its load needs it on a loaded machine.
func (te *testEngine) keepAlive(period time.Duration) {
	testkit.Every(te.e.t, period, func() {
		_, _ = te.tryLookup([]string{hash("alive", 0)}, period) // a slow reply is no failure: the next tick asks again
	})
}

// awaitLookup waits (10 s at most) until te's lookup of hashes counts want
// tokens: another node's announcement has reached te's node.
func awaitLookup(t *testing.T, te *testEngine, hashes []string, want int, who string) {
	t.Helper()
	testkit.Eventually(t, 10*time.Second, 10*time.Millisecond, func() error {
		got, err := te.tryLookup(hashes, time.Second)
		if err != nil {
			return fmt.Errorf("%s: %w", who, err)
		}
		if got != want {
			return fmt.Errorf("%s counts %d tokens, want %d", who, got, want)
		}
		return nil
	})
}

func chunkIndexes(s messages.Stored) []int {
	out := make([]int, len(s.Chunks))
	for i, c := range s.Chunks {
		out[i] = c.Index
	}
	return out
}

// PROTOCOL.md "deferred, never skipped": a missing key stores chunk 0 only,
// then chunk 1 once its hash arrives; the bytes that come back by load are
// the bytes the engine wrote.
func TestHashLagStoresChunkOnceHashArrives(t *testing.T) {
	t.Parallel()
	e := startNode(t)
	te := e.newEngine("e1", defaultOpts())
	te.register()
	te.fill(0, 5, 1)
	te.fill(0, 6, 1)
	h := []string{hash("a", 0), hash("a", 1)}
	te.send(added("r1", 8), blocksEv("r1", 0, 0, 5, 6), hashesEv("r1", 0, h[0]), tokensEv("r1", 8, 8))
	st := recv(t, te.stored, "stored job 1")
	require.Equal(t, []int{0}, chunkIndexes(st))
	require.Equal(t, "r1", st.Request)
	require.EqualValues(t, 256, st.Bytes)
	kv := recv(t, te.kv, "BlockStored")
	require.Equal(t, messages.KVBlockStored, kv.Events[0].Type)
	require.Equal(t, []string{h[0]}, kv.Events[0].BlockHashes)

	te.send(hashesEv("r1", 1, h[1]))
	st = recv(t, te.stored, "stored job 2")
	require.Equal(t, []int{1}, chunkIndexes(st))
	require.Equal(t, 8, te.lookup(h))

	// Load both chunks into blocks 20, 21 and compare every byte.
	r := te.loadInto("r2", h, 8, []int{20, 21})
	require.True(t, r.OK, r.Error)
	require.Equal(t, 8, r.LoadedTokens)
	require.True(t, bytes.Equal(te.block(0, 5), te.block(0, 20)), "chunk 0 bytes")
	require.True(t, bytes.Equal(te.block(0, 6), te.block(0, 21)), "chunk 1 bytes")

	te.send(finishedEv("r1", false, 8, 8))
	rel := recv(t, te.released, "released")
	require.Equal(t, messages.Released{Request: "r1", Reason: "finished"}, rel)
}
