package wire

import (
	"encoding/hex"
	"encoding/json"
	"fmt"
	"testing"
	"testing/quick"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

// AppendReleased produces exactly encoding/json's bytes, for any request id
// (quotes, control characters, invalid UTF-8, HTML characters).
func TestReleasedMatchesEncodingJSON(t *testing.T) {
	check := func(req, epoch string, rseq uint64) bool {
		rel := &messages.Released{Request: req, Epoch: epoch + req, RSeq: rseq, Reason: "finished"}
		want, err := json.Marshal(rel)
		got := AppendReleased(nil, rel)
		if err != nil || string(want) != string(got) {
			t.Logf("want %s\n got %s", want, got)
			return false
		}
		return true
	}
	require.NoError(t, quick.Check(check, &quick.Config{MaxCount: 2000}))
	require.True(t, check("r\"1\\\n<&>\xff", "", 0))
	require.True(t, check("plain-id", "e", 1<<63))
}

// The pieces the journal writes a body with, hashes hex-encoded from their
// raw bytes, make what encoding/json makes of the batch with hex strings.
func TestKVPiecesMatchEncodingJSON(t *testing.T) {
	check := func(raw [][]byte, typ, ns string, group int, ts float64) bool {
		hexes := make([]string, len(raw))
		b := AppendKVBatchOpen(nil, ts)
		b = AppendKVEventOpen(b, typ)
		for i, r := range raw {
			hexes[i] = hex.EncodeToString(r)
			if i > 0 {
				b = append(b, ',')
			}
			b = AppendHexString(b, string(r))
		}
		b = AppendKVEventClose(b, group, messages.MediumCPU, ns)
		b = append(b, ',')
		b = AppendKVEventOpen(b, messages.KVBlockRemoved)
		b = AppendKVBatchClose(AppendKVEventClose(b, 1, messages.MediumDisk, ""))
		want, err := json.Marshal(&messages.KVEventBatch{TS: ts, Events: []messages.KVEvent{
			{Type: typ, BlockHashes: hexes, GroupIdx: group, Medium: messages.MediumCPU, Namespace: ns},
			{Type: messages.KVBlockRemoved, BlockHashes: []string{}, GroupIdx: 1, Medium: messages.MediumDisk}}})
		if err != nil || string(want) != string(b) {
			t.Logf("want %s\n got %s", want, b)
			return false
		}
		return true
	}
	require.NoError(t, quick.Check(check, &quick.Config{MaxCount: 2000}))
	// v2's namespace: omitted when empty, escaped like any string.
	require.True(t, check([][]byte{{0xab}}, messages.KVBlockStored, "llama \"70b\" <fp8>\xff", 0, 1))
	require.True(t, check([][]byte{{0xab}}, messages.KVBlockStored, "", 0, 1732894000.123456))
}

// A stored body written with the pieces, keys hex-encoded from their raw
// bytes, is what encoding/json makes of the message with hex keys.
func TestStoredPiecesMatchEncodingJSON(t *testing.T) {
	check := func(req string, job uint64, raw [][]byte, group, index int, bytes int64) bool {
		st := &messages.Stored{Request: req, Job: job, Bytes: bytes, Chunks: []messages.StoredChunk{}}
		b := AppendStoredOpen(nil, req, job)
		for i, r := range raw {
			st.Chunks = append(st.Chunks, messages.StoredChunk{Group: group + i, Index: index - i, Key: hex.EncodeToString(r)})
			if i > 0 {
				b = append(b, ',')
			}
			b = AppendStoredChunkHex(b, group+i, index-i, string(r))
		}
		b = AppendStoredClose(b, bytes)
		want, err := json.Marshal(st)
		if err != nil || string(want) != string(b) {
			t.Logf("want %s\n got %s", want, b)
			return false
		}
		return true
	}
	require.NoError(t, quick.Check(check, &quick.Config{MaxCount: 2000}))
	require.True(t, check("r\"1\\\n<&>\xff", 0, nil, 0, 0, 0), "an escaped request id, no chunks")
	require.True(t, check("plain-id", 1<<63, [][]byte{{0, 0xff}, {}}, -1, 7, -5))
}

// AppendHex is encoding/hex's lowercase encoding.
func TestAppendHexMatchesEncodingHex(t *testing.T) {
	check := func(prefix []byte, s string) bool {
		return string(AppendHex(append([]byte(nil), prefix...), s)) == string(prefix)+hex.EncodeToString([]byte(s))
	}
	require.NoError(t, quick.Check(check, nil))
	require.Equal(t, "00ff10", string(AppendHex(nil, "\x00\xff\x10")))
}

// BenchmarkKVPieces: a completion step's kv_events written as the journal
// writes them, 2 events of 8 32-byte hashes (64 hex characters each).
func BenchmarkKVPieces(b *testing.B) {
	hashes := make([]string, 8)
	for i := range hashes {
		hashes[i] = fmt.Sprintf("%032d", i)
	}
	var buf []byte
	b.ReportAllocs()
	for range b.N {
		buf = AppendKVBatchOpen(buf[:0], 1732894000.123456)
		for ev, typ := range []string{messages.KVBlockStored, messages.KVBlockRemoved} {
			if ev > 0 {
				buf = append(buf, ',')
			}
			buf = AppendKVEventOpen(buf, typ)
			for i, h := range hashes {
				if i > 0 {
					buf = append(buf, ',')
				}
				buf = AppendHexString(buf, h)
			}
			buf = AppendKVEventClose(buf, ev, messages.MediumCPU, "")
		}
		buf = AppendKVBatchClose(buf)
	}
}
