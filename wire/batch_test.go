package wire_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/ingest"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/wire"
)

// A Batch decodes, through kvactors' own ingest, to exactly the events it
// was given, in order (request ids with characters JSON must escape too).
func TestBatchDecodesToItsEvents(t *testing.T) {
	var b wire.Batch
	req := "r\"1\\é\n"
	b.Added(req, 8)
	b.BeginHashes(req, 0)
	b.Hash([]byte{0xab, 0x01})
	b.Hash([]byte{0xff})
	b.EndHashes()
	b.BeginHashes(req, 2) // an empty list is an event too
	b.EndHashes()
	b.Blocks(req, 1, 0, []uint32{3, 0, 4294967295})
	b.Tokens(req, 4, 8)
	b.Preempted(req)
	b.Resumed(req)
	b.Finished(req, true, 2, 8)
	require.Equal(t, 8, b.Events())

	got, bad, err := ingest.DecodeBatch("e", b.Body(nil, "ep\"1", 7), ingest.Limits{})
	require.NoError(t, err)
	require.Empty(t, bad)
	require.Equal(t, "ep\"1", got.Epoch)
	require.EqualValues(t, 7, got.Seq)
	want := []messages.Event{
		{Type: messages.EvAdded, Request: req, PromptTokens: 8, MaxOffloadTokens: -1},
		{Type: messages.EvHashes, Request: req, Hashes: []messages.Hash{"\xab\x01", "\xff"}},
		{Type: messages.EvHashes, Request: req, Start: 2, Hashes: []messages.Hash{}},
		{Type: messages.EvBlocks, Request: req, Group: 1, IDs: []messages.BlockID{3, 0, 4294967295}},
		{Type: messages.EvTokens, Request: req, Computed: 4, Total: 8},
		{Type: messages.EvPreempted, Request: req},
		{Type: messages.EvResumed, Request: req},
		{Type: messages.EvFinished, Request: req, Aborted: true, Computed: 2, Total: 8},
	}
	require.Len(t, got.Events, len(want))
	for i := range want {
		w, g := want[i], got.Events[i]
		if len(w.Hashes) == 0 && len(g.Hashes) == 0 {
			w.Hashes, g.Hashes = nil, nil
		}
		require.Equal(t, w, g, "event %d", i)
	}

	b.Reset()
	require.Zero(t, b.Events())
	require.Equal(t, `{"epoch":"x","seq":1,"events":[]}`, string(b.Body(nil, "x", 1)))
}

// AddedMax carries max_offload_tokens.
func TestBatchAddedMax(t *testing.T) {
	var b wire.Batch
	b.AddedMax("r", 64, 16)
	got, bad, err := ingest.DecodeBatch("e", b.Body(nil, "ep", 1), ingest.Limits{})
	require.NoError(t, err)
	require.Empty(t, bad)
	require.Equal(t, []messages.Event{{Type: messages.EvAdded, Request: "r", PromptTokens: 64, MaxOffloadTokens: 16}},
		got.Events)
}
