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

// The hand-written encoders produce exactly encoding/json's bytes, for any
// request id (quotes, control characters, invalid UTF-8, HTML characters).
func TestEncodersMatchEncodingJSON(t *testing.T) {
	check := func(req, key, hash string, job uint64, group, index int, bytes int64, ts float64) bool {
		st := &messages.Stored{Request: req, Job: job, Bytes: bytes,
			Chunks: []messages.StoredChunk{{Group: group, Index: index, Key: key}, {Group: 1, Index: 2, Key: "ab"}}}
		rel := &messages.Released{Request: req, Epoch: hash + req, RSeq: job, Reason: "finished"}
		kv := &messages.KVEventBatch{TS: ts, Events: []messages.KVEvent{
			{Type: messages.KVBlockStored, BlockHashes: []string{hash, "00"}, GroupIdx: group, Medium: "CPU"},
			{Type: messages.KVBlockRemoved, GroupIdx: 3, Medium: "CPU", Namespace: req}}}
		for _, c := range []struct {
			v   any
			got []byte
		}{{st, AppendStored(nil, st)}, {rel, AppendReleased(nil, rel)}, {kv, AppendKVEvents(nil, kv)}} {
			want, err := json.Marshal(c.v)
			if err != nil || string(want) != string(c.got) {
				t.Logf("want %s\n got %s", want, c.got)
				return false
			}
		}
		return true
	}
	require.NoError(t, quick.Check(check, &quick.Config{MaxCount: 2000}))
	require.True(t, check("r\"1\\\n<&>\xff", "k", "", 0, 0, 0, 0, 1732894000.123456))
	require.True(t, check("plain-id", "00ff", "abcd", 1<<63, -1, 7, -5, 0))
	empty := &messages.Stored{Request: "r"}
	want, _ := json.Marshal(empty)
	require.Equal(t, string(want), string(AppendStored(nil, empty)))
}

// v2: kv_events carry "namespace" (omitted when empty, as encoding/json's
// omitempty does), escaped like any string.
func TestKVEventsNamespaceMatchesEncodingJSON(t *testing.T) {
	check := func(ns, hash string, group int, ts float64) bool {
		kv := &messages.KVEventBatch{TS: ts, Events: []messages.KVEvent{
			{Type: messages.KVBlockStored, BlockHashes: []string{hash}, GroupIdx: group, Medium: "CPU", Namespace: ns},
			{Type: messages.KVBlockRemoved, GroupIdx: 3, Medium: "CPU"}}}
		want, err := json.Marshal(kv)
		got := AppendKVEvents(nil, kv)
		if err != nil || string(want) != string(got) {
			t.Logf("want %s\n got %s", want, got)
			return false
		}
		return true
	}
	require.NoError(t, quick.Check(check, &quick.Config{MaxCount: 2000}))
	require.True(t, check("llama \"70b\" <fp8>\xff", "ab", 0, 1))
	require.True(t, check("", "ab", 0, 1))
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
}

// AppendHex is encoding/hex's lowercase encoding.
func TestAppendHexMatchesEncodingHex(t *testing.T) {
	check := func(prefix []byte, s string) bool {
		return string(AppendHex(append([]byte(nil), prefix...), s)) == string(prefix)+hex.EncodeToString([]byte(s))
	}
	require.NoError(t, quick.Check(check, nil))
	require.Equal(t, "00ff10", string(AppendHex(nil, "\x00\xff\x10")))
}

// BenchmarkAppendKVEvents: a completion step's kv_events, 2 events of 8
// 32-byte hashes (64 hex characters each).
func BenchmarkAppendKVEvents(b *testing.B) {
	hashes := make([]string, 8)
	for i := range hashes {
		hashes[i] = hex.EncodeToString([]byte(fmt.Sprintf("%032d", i)))
	}
	batch := &messages.KVEventBatch{TS: 1732894000.123456, Events: []messages.KVEvent{
		{Type: messages.KVBlockStored, BlockHashes: hashes, GroupIdx: 0, Medium: messages.MediumCPU},
		{Type: messages.KVBlockRemoved, BlockHashes: hashes, GroupIdx: 1, Medium: messages.MediumCPU}}}
	var buf []byte
	b.ReportAllocs()
	for range b.N {
		buf = AppendKVEvents(buf[:0], batch)
	}
}
