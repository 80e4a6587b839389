package sched

import (
	"encoding/json"
	"math"
	"testing"
	"testing/quick"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

// PROTOCOL.md "EngineSpec" and "Words": NewLayout rejects every spec the core
// could not trust (raft's Config.validate habit).
func TestNewLayoutRejects(t *testing.T) {
	for _, tc := range []struct {
		name string
		mod  func(s *messages.EngineSpec)
	}{
		{"tokens_per_hash 0", func(s *messages.EngineSpec) { s.TokensPerHash = 0 }},
		{"tokens_per_hash negative", func(s *messages.EngineSpec) { s.TokensPerHash = -4 }},
		{"blocks_per_chunk 0", func(s *messages.EngineSpec) { s.BlocksPerChunk = 0 }},
		{"num_gpu_blocks 0", func(s *messages.EngineSpec) { s.NumGPUBlocks = 0 }},
		{"num_gpu_blocks past 2^31", func(s *messages.EngineSpec) { s.NumGPUBlocks = 1<<31 + 1 }},
		{"no groups", func(s *messages.EngineSpec) { s.Groups = nil }},
		{"unknown kind", func(s *messages.EngineSpec) { s.Groups[0].Kind = "mamba" }},
		{"empty kind", func(s *messages.EngineSpec) { s.Groups[0].Kind = "" }},
		{"sliding window 0", func(s *messages.EngineSpec) { s.Groups[1].SlidingWindow = 0 }},
		{"tokens_per_block 0", func(s *messages.EngineSpec) { s.Groups[0].TokensPerBlock = 0 }},
		{"tokens_per_chunk not a multiple of tokens_per_hash", func(s *messages.EngineSpec) {
			s.Groups[1].TokensPerBlock = 6 // 6*2 = 12, not a multiple of 8
			s.TokensPerHash = 8
		}},
		{"no regions", func(s *messages.EngineSpec) { s.Groups[0].Regions = nil }},
		{"region segment negative", func(s *messages.EngineSpec) { s.Groups[0].Regions[0].Segment = -1 }},
		{"region segment past the segments", func(s *messages.EngineSpec) { s.Groups[1].Regions[0].Segment = 1 }},
		{"region offset negative", func(s *messages.EngineSpec) { s.Groups[0].Regions[0].Offset = -1 }},
		{"region block_bytes 0", func(s *messages.EngineSpec) { s.Groups[0].Regions[0].BlockBytes = 0 }},
		{"region stride below block_bytes", func(s *messages.EngineSpec) { s.Groups[0].Regions[0].BlockStride = 32 }},
		{"no segments", func(s *messages.EngineSpec) { s.Segments = nil }},
		// A wrapped chunk size is negative and would pass every "fits" check.
		{"block_bytes over the regions overflow", func(s *messages.EngineSpec) {
			r := messages.Region{BlockBytes: math.MaxInt64 / 2, BlockStride: math.MaxInt64 / 2}
			s.Groups[0].Regions = []messages.Region{r, r, r}
		}},
		{"chunk bytes overflow", func(s *messages.EngineSpec) {
			s.Groups[0].Regions[0].BlockBytes, s.Groups[0].Regions[0].BlockStride = math.MaxInt64/2+1, math.MaxInt64/2+1
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := spec(4, 2, full(4), swa(4, 8))
			_, err := NewLayout(s)
			require.NoError(t, err, "the base spec is valid")
			tc.mod(s)
			l, err := NewLayout(s)
			require.ErrorIs(t, err, ErrBadLayout)
			require.Nil(t, l)
		})
	}
}

// PROTOCOL.md "Words": tokens_per_chunk[g] = tokens_per_block[g] * bpc and
// hashes_per_chunk[g] = tokens_per_chunk[g] / tph; a chunk's host copy is its
// blocks, each block its regions.
func TestNewLayoutDerivesGeometry(t *testing.T) {
	s := spec(4, 3, full(4), swa(8, 64), eagle(4))
	s.Groups[0].Regions = append(s.Groups[0].Regions,
		messages.Region{Segment: 0, Offset: 1 << 30, BlockStride: 128, BlockBytes: 100})
	l := mustLayout(t, s)
	require.Len(t, l.Groups, 3)
	for i, want := range []GroupLayout{
		{Kind: KindFull, TokensPerBlock: 4, TokensPerChunk: 12, HashesPerChunk: 3, BlockBytes: 164, ChunkBytes: 492,
			MaxBlocks: 128},
		{Kind: KindSlidingWindow, TokensPerBlock: 8, TokensPerChunk: 24, HashesPerChunk: 6, SlidingWindow: 64,
			BlockBytes: 64, ChunkBytes: 192, MaxBlocks: 64},
		{Kind: KindEagle, TokensPerBlock: 4, TokensPerChunk: 12, HashesPerChunk: 3, BlockBytes: 64, ChunkBytes: 192,
			MaxBlocks: 128},
	} {
		got := l.Groups[i]
		got.Regions = nil
		require.Equal(t, want, got, "group %d", i)
	}
	require.Equal(t, int64(492), l.MaxChunkBytes())
	require.Equal(t, 4, l.TokensPerHash)
	require.Equal(t, 3, l.BlocksPerChunk)
	require.Equal(t, 64, l.NumGPUBlocks)
	// PROTOCOL.md "Isolation": max_model_len defaults to num_gpu_blocks times
	// the largest tokens_per_block (64 * 8 = 512 tokens).
	require.Equal(t, 128, l.MaxHashes)
}

// PROTOCOL.md "Isolation", bounds: ceil(max_model_len / tph) hashes and
// ceil(max_model_len / tokens_per_block[g]) block ids per group.
func TestLayoutMaxModelLen(t *testing.T) {
	s := spec(4, 2, full(4), swa(8, 16))
	s.MaxModelLen = 101
	l := mustLayout(t, s)
	require.Equal(t, 26, l.MaxHashes)
	require.Equal(t, 26, l.Groups[0].MaxBlocks)
	require.Equal(t, 13, l.Groups[1].MaxBlocks)
	s.MaxModelLen = math.MaxInt
	l = mustLayout(t, s)
	require.Equal(t, math.MaxInt32, l.MaxHashes, "a huge bound is capped, not wrapped")
	require.Equal(t, math.MaxInt32, l.Groups[1].MaxBlocks)
	s.MaxModelLen = -1
	_, err := NewLayout(s)
	require.ErrorIs(t, err, ErrBadLayout)
}

// PROTOCOL.md "Isolation", bounds: the node's --max-model-len lowers the
// bounds a spec derives (and never raises them).
func TestLayoutCapModelLen(t *testing.T) {
	s := spec(4, 2, full(4), swa(8, 16)) // no max_model_len: 64 blocks × 8 tokens = 512
	l := mustLayout(t, s)
	require.Equal(t, 128, l.MaxHashes)
	l.CapModelLen(101)
	require.Equal(t, 26, l.MaxHashes)
	require.Equal(t, 26, l.Groups[0].MaxBlocks)
	require.Equal(t, 13, l.Groups[1].MaxBlocks)
	l.CapModelLen(1 << 20)
	require.Equal(t, 26, l.MaxHashes, "a higher cap raises nothing")
}

// docs/SECURITY.md "Address space": the node maps of each segment only the
// span its regions use, and refuses a segment no region uses.
func TestLayoutSpans(t *testing.T) {
	s := spec(4, 1, full(4), full(4), full(4)) // regions at 0, 1 MiB, 2 MiB of segment 0
	s.Segments = append(s.Segments, messages.Segment{Shm: "seg2"})
	s.Groups[1].Regions = append(s.Groups[1].Regions,
		messages.Region{Segment: 1, Offset: 5000, BlockStride: 128, BlockBytes: 100})
	spans, err := mustLayout(t, s).Spans(2)
	require.NoError(t, err)
	require.Equal(t, []Span{{Off: 0, End: 2<<20 + 63*testBlockBytes + testBlockBytes}, {Off: 5000, End: 5000 + 63*128 + 100}},
		spans)

	s.Segments = append(s.Segments, messages.Segment{Shm: "seg3"})
	_, err = mustLayout(t, s).Spans(3)
	require.ErrorIs(t, err, ErrBadLayout)
	require.ErrorContains(t, err, "segment 2: no region uses it")

	big := spec(4, 1, full(4))
	big.Groups[0].Regions[0] = messages.Region{Offset: math.MaxInt64 - 10, BlockStride: 1 << 40, BlockBytes: 8}
	_, err = mustLayout(t, big).Spans(1)
	require.ErrorIs(t, err, ErrBadLayout, "offset + 63 × stride overflows")
	big.NumGPUBlocks = 1
	big.Groups[0].Regions[0] = messages.Region{Offset: math.MaxInt64 - 4, BlockStride: 8, BlockBytes: 8}
	_, err = mustLayout(t, big).Spans(1)
	require.ErrorIs(t, err, ErrBadLayout, "offset + bytes overflows")
}

// PROTOCOL.md "EngineSpec": "Every region must lie inside its segment."
func TestCheckSegments(t *testing.T) {
	// 64 blocks of 64 bytes at offset 0 (group 0) and 1 MiB (group 1).
	l := layout(t, 4, 1, full(4), full(4))
	end1 := int64(1<<20) + 63*testBlockBytes + testBlockBytes
	for _, tc := range []struct {
		name string
		size int64
		ok   bool
	}{
		{"exactly large enough", end1, true},
		{"larger", end1 + 1, true},
		{"one byte short", end1 - 1, false},
		{"empty segment", 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := l.CheckSegments(func(int) int64 { return tc.size })
			if tc.ok {
				require.NoError(t, err)
			} else {
				require.ErrorIs(t, err, ErrBadLayout)
			}
		})
	}
	t.Run("overflowing stride", func(t *testing.T) {
		s := spec(4, 1, full(4))
		s.Groups[0].Regions[0].BlockStride = math.MaxInt64 / 2
		err := mustLayout(t, s).CheckSegments(func(int) int64 { return math.MaxInt64 })
		require.ErrorIs(t, err, ErrBadLayout)
	})
	t.Run("offset plus block bytes overflowing with one block", func(t *testing.T) {
		s := spec(4, 1, full(4))
		s.NumGPUBlocks = 1
		s.Groups[0].Regions[0].Offset = math.MaxInt64 - 10
		require.ErrorIs(t, mustLayout(t, s).CheckSegments(func(int) int64 { return math.MaxInt64 }), ErrBadLayout)
	})
	t.Run("stride whose product wraps to a small offset", func(t *testing.T) {
		// last*stride ≡ m (mod 2^64), m small, for a valid positive stride:
		// without an overflow check the region "ends" inside a 1 MiB segment.
		s := spec(4, 1, full(4))
		s.NumGPUBlocks = 1 << 31
		last := uint64(s.NumGPUBlocks - 1) // odd, so invertible mod 2^64
		inv := last
		for range 6 {
			inv *= 2 - last*inv
		}
		require.Equal(t, uint64(1), last*inv)
		var stride uint64
		for m := uint64(1); ; m++ { // the smallest wrapped product a valid stride gives
			if x := inv * m; x < 1<<63 && x >= testBlockBytes {
				stride = x
				break
			}
		}
		require.Less(t, int64(last*stride), int64(1<<20), "the product wraps to a small offset")
		s.Groups[0].Regions[0].BlockStride = int64(stride)
		l := mustLayout(t, s)
		require.ErrorIs(t, l.CheckSegments(func(int) int64 { return 1 << 20 }), ErrBadLayout)
	})
	t.Run("asks for the region's own segment", func(t *testing.T) {
		s := spec(4, 1, full(4), full(4))
		s.Segments = append(s.Segments, messages.Segment{Shm: "seg2"})
		s.Groups[1].Regions[0] = messages.Region{Segment: 1, Offset: 0, BlockStride: 64, BlockBytes: 64}
		sizes := map[int]int64{0: 64 * 64, 1: 64 * 64}
		require.NoError(t, mustLayout(t, s).CheckSegments(func(i int) int64 { return sizes[i] }))
		sizes[1] = 64*64 - 1
		require.ErrorIs(t, mustLayout(t, s).CheckSegments(func(i int) int64 { return sizes[i] }), ErrBadLayout)
	})
}

// PROTOCOL.md "offload key": the chunk's last block hash followed by the group
// as 4 big-endian bytes, behind the namespace id (PROTOCOL.md "Isolation");
// SplitKey inverts it and WireKey drops the namespace.
func TestKeySplitKeyRoundTrip(t *testing.T) {
	roundTrip := func(ns uint32, h []byte, g uint32) bool {
		g &= math.MaxInt32 // group indexes are non-negative ints
		k := Key(NamespaceID(ns), messages.Hash(h), int(g))
		gotNS, gotH, gotG := SplitKey(k)
		return len(k) == 4+len(h)+4 && gotNS == NamespaceID(ns) && gotH == messages.Hash(h) && gotG == int(g) &&
			WireKey(k) == messages.Key(string(h)+string(k[len(k)-4:])) &&
			string(AppendKey([]byte("x"), NamespaceID(ns), messages.Hash(h), int(g))) == "x"+string(k)
	}
	require.NoError(t, quick.Check(roundTrip, &quick.Config{MaxCount: 2000}))
	require.Equal(t, messages.Key("\x00\x00\x01\x07ab\x00\x00\x01\x02"), Key(263, "ab", 258))
	require.Equal(t, messages.Key("\x00\x00\x00\x00\x00\x00\x00\x00"), Key(0, "", 0))
	ns, h, g := SplitKey("ab")
	require.Equal(t, messages.Hash("ab"), h, "a key shorter than 8 bytes is all hash")
	require.Zero(t, g)
	require.Zero(t, ns)
	require.NotEqual(t, Key(1, "ab", 0), Key(2, "ab", 0), "namespaces never share a key")
}

// The String values are metric labels, span attributes and status JSON
// (STYLE.md, raft's named types); PROTOCOL.md names the group kinds.
func TestEnumStrings(t *testing.T) {
	require.Equal(t, []string{"none", "tokens", "hashes", "blocks"},
		[]string{DeferNone.String(), DeferTokens.String(), DeferHashes.String(), DeferBlocks.String()})
	require.Equal(t, []string{"running", "preempted", "finishing", "done"},
		[]string{Running.String(), Preempted.String(), Finishing.String(), Done.String()})
	require.Equal(t, []string{"pool_full", "copy_failed", "pending"},
		[]string{RetryPoolFull.String(), RetryCopyFailed.String(), RetryPending.String()})
	require.Equal(t, []string{"pool_full", "copy_failed", "pending"}, RetryLabels())
	require.Equal(t, []string{"full", "sliding_window", "eagle"},
		[]string{KindFull.String(), KindSlidingWindow.String(), KindEagle.String()})
}

// The status endpoint (PROTOCOL.md "P.E.status": per-group cursors and ready
// prefix, in-flight jobs) serves RequestSnapshot as JSON.
func TestSnapshotJSON(t *testing.T) {
	h := newHarness(t, layout(t, 4, 1, full(4), full(8)), 64, added(12))
	h.step(hashes(0, 3), blocks(0, 0, 1, 2), blocks(1, 0, 4), tokens(12, 12))
	h.advance()
	b, err := json.Marshal(h.req.Snapshot())
	require.NoError(t, err)
	require.JSONEq(t, `{"request":"r1","phase":"running","prompt_tokens":12,"computed":12,"total":12,
		"offloadable_tokens":12,"hashes":3,"in_flight":[1],
		"groups":[{"cursor":2,"ready":2,"deferred":"blocks","blocks":2,"redo":[]},
		          {"cursor":1,"ready":1,"deferred":"none","blocks":1,"redo":[]}]}`, string(b))

	// A snapshot shares no memory with the request.
	s := h.req.Snapshot()
	s.InFlight[0] = 99
	require.Equal(t, []JobID{1}, h.req.Snapshot().InFlight)
}
