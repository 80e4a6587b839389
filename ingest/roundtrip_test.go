package ingest

import (
	"encoding/json"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

// randomEvent returns a valid event of a random type with random values
// (within fuzzLimits), including request ids that need JSON escapes.
func randomEvent(r *rand.Rand) messages.Event {
	ids := []string{"r1", "a.b.*", `q"\`, "é😀", "<tag>&", strings.Repeat("x", 16)}
	ev := messages.Event{Type: messages.EventType(1 + r.IntN(7)), Request: ids[r.IntN(len(ids))]}
	switch ev.Type {
	case messages.EvAdded:
		ev.PromptTokens = r.IntN(1 << 20)
		ev.MaxOffloadTokens = r.IntN(3) - 1
		if ev.MaxOffloadTokens == 1 {
			ev.MaxOffloadTokens = r.IntN(1 << 20)
		}
	case messages.EvHashes:
		ev.Start = r.IntN(1000)
		for range r.IntN(fuzzLimits.MaxIDs + 1) {
			h := make([]byte, 1+r.IntN(fuzzLimits.MaxHashBytes))
			for i := range h {
				h[i] = byte(r.Uint32())
			}
			ev.Hashes = append(ev.Hashes, messages.Hash(h))
		}
	case messages.EvBlocks:
		ev.Group, ev.Start = r.IntN(fuzzLimits.MaxGroups), r.IntN(1000)
		for range r.IntN(fuzzLimits.MaxIDs + 1) {
			ev.IDs = append(ev.IDs, messages.BlockID(r.Uint32()))
		}
	case messages.EvTokens, messages.EvFinished:
		ev.Computed, ev.Total = r.IntN(1<<30), r.IntN(1<<30)
		ev.Aborted = ev.Type == messages.EvFinished && r.IntN(2) == 0
	}
	return ev
}

// TestDecodeBatchRoundTrip: batches encoded by encoding/json (as a Go engine
// would, omitempty included) decode to exactly the events encoded.
func TestDecodeBatchRoundTrip(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for i := range 500 {
		want := make([]messages.Event, r.IntN(fuzzLimits.MaxEvents+1))
		raw := make([]json.RawMessage, len(want))
		for j := range want {
			want[j] = randomEvent(r)
			raw[j] = json.RawMessage(encodeEvent(t, want[j]))
		}
		body, err := json.MarshalIndent(map[string]any{"epoch": "ép", "seq": i, "events": raw}, "", " ")
		require.NoError(t, err)
		b, bad, err := DecodeBatch("e1", body, fuzzLimits)
		require.NoError(t, err)
		require.Empty(t, bad)
		require.Equal(t, uint64(i), b.Seq)
		require.Equal(t, "ép", b.Epoch)
		if len(want) == 0 {
			require.Empty(t, b.Events)
			continue
		}
		require.Equal(t, want, b.Events, "batch %d: %s", i, body)
	}
}
