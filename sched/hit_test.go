package sched

import (
	"fmt"
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

func hitLayout(t *testing.T, groups ...messages.GroupSpec) *Layout {
	t.Helper()
	for i := range groups {
		groups[i].Regions = []messages.Region{{BlockStride: 8, BlockBytes: 8}}
	}
	l, err := NewLayout(&messages.EngineSpec{TokensPerHash: 4, BlocksPerChunk: 1, NumGPUBlocks: 64,
		Segments: []messages.Segment{{Shm: "s"}}, Groups: groups})
	require.NoError(t, err)
	return l
}

func hitHashes(n int) []messages.Hash {
	hs := make([]messages.Hash, n)
	for i := range hs {
		hs[i] = messages.Hash(fmt.Sprintf("h%02d", i))
	}
	return hs
}

// readySet marks (group, chunk) pairs stored, by key.
func readySet(l *Layout, hs []messages.Hash, chunks map[int][]int) func(messages.Key) bool {
	set := map[messages.Key]bool{}
	for g, cs := range chunks {
		hpc := l.Groups[g].HashesPerChunk
		for _, c := range cs {
			set[Key(0, hs[(c+1)*hpc-1], g)] = true
		}
	}
	return func(k messages.Key) bool { return set[k] }
}

// PROTOCOL.md "lookup" and kvactors' rule for the other group kinds
// (docs/PROTOCOL.md): the hit is the minimum over full groups of the leading
// ready chunks; eagle groups need every chunk below it, sliding-window groups
// only those overlapping the window before it.
func TestHitTokens(t *testing.T) {
	full := messages.GroupSpec{Kind: "full", TokensPerBlock: 4}
	full8 := messages.GroupSpec{Kind: "full", TokensPerBlock: 8}
	sw := messages.GroupSpec{Kind: "sliding_window", TokensPerBlock: 4, SlidingWindow: 8}
	eagle := messages.GroupSpec{Kind: "eagle", TokensPerBlock: 4}
	hs := hitHashes(8)
	cases := []struct {
		name   string
		groups []messages.GroupSpec
		stored map[int][]int
		want   int
	}{
		{"stops at the first miss", []messages.GroupSpec{full}, map[int][]int{0: {0, 1, 3}}, 8},
		{"nothing stored", []messages.GroupSpec{full}, map[int][]int{}, 0},
		{"all stored", []messages.GroupSpec{full}, map[int][]int{0: {0, 1, 2, 3, 4, 5, 6, 7}}, 32},
		{"minimum over full groups", []messages.GroupSpec{full, full8}, map[int][]int{0: {0, 1, 2, 3, 4, 5}, 1: {0}}, 8},
		{"window needs only its last chunks", []messages.GroupSpec{full, sw},
			map[int][]int{0: {0, 1, 2, 3}, 1: {2, 3}}, 16},
		{"window chunk missing steps the hit down", []messages.GroupSpec{full, sw},
			map[int][]int{0: {0, 1, 2, 3}, 1: {1, 2}}, 12},
		{"eagle needs every chunk below the hit", []messages.GroupSpec{full, eagle},
			map[int][]int{0: {0, 1, 2, 3}, 1: {0, 1}}, 8},
		{"no full group: no hit", []messages.GroupSpec{sw}, map[int][]int{0: {0, 1}}, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			l := hitLayout(t, c.groups...)
			require.Equal(t, c.want, l.HitTokens(hs, readySet(l, hs, c.stored)))
		})
	}
}

// PROTOCOL.md "load": chunks [0, N / tokens_per_chunk[g]) of every group;
// all-zero chunks are left out; the body must fit the layout.
func TestLoadChunks(t *testing.T) {
	l := hitLayout(t, messages.GroupSpec{Kind: "full", TokensPerBlock: 4},
		messages.GroupSpec{Kind: "sliding_window", TokensPerBlock: 8, SlidingWindow: 8})
	hs := hitHashes(4)
	chunks, err := l.LoadChunks(hs, 16, [][]messages.BlockID{{5, 6, 7, 8}, {0, 9}})
	require.NoError(t, err)
	require.Len(t, chunks, 5)
	require.Equal(t, Key(0, hs[3], 0), chunks[3].Key)
	require.Equal(t, JobChunk{Group: 1, Index: 1, Key: Key(0, hs[3], 1), Blocks: []messages.BlockID{9}}, chunks[4])

	for name, blocks := range map[string][][]messages.BlockID{
		"too few lists":   {{5, 6, 7, 8}},
		"too few ids":     {{5, 6}, {0, 9}},
		"id out of range": {{5, 6, 7, 64}, {0, 9}},
	} {
		_, err := l.LoadChunks(hs, 16, blocks)
		require.ErrorIs(t, err, ErrBadLoad, name)
	}
	_, err = l.LoadChunks(hs[:2], 16, [][]messages.BlockID{{5, 6, 7, 8}, {0, 9}})
	require.ErrorIs(t, err, ErrBadLoad, "too few hashes")
	_, err = l.LoadChunks(hs[:3], 16, [][]messages.BlockID{{5, 6, 7, 8}, {0, 9}})
	require.ErrorIs(t, err, ErrBadLoad, "one hash too few")
}

// A load past what a request may hold (max_model_len, else num_gpu_blocks'
// worth) is refused too_large, whatever its hashes and block lists: one
// hash repeated 200,000 times with as many block ids made one load copy
// 50 GB, holding every engine's copies behind it.
func TestALoadPastAnyRequestsLengthIsTooLarge(t *testing.T) {
	l := hitLayout(t, messages.GroupSpec{Kind: "full", TokensPerBlock: 4})
	most := l.Groups[0].MaxBlocks // chunks of one block, one hash each
	hs := make([]messages.Hash, most+1)
	for i := range hs {
		hs[i] = hitHashes(1)[0] // one chunk's hash, repeated
	}
	ids := make([]messages.BlockID, most+1)
	for i := range ids {
		ids[i] = 1
	}
	chunks, err := l.LoadChunks(hs[:most], most*4, [][]messages.BlockID{ids[:most]})
	require.NoError(t, err, "a request's full length")
	require.Len(t, chunks, most)
	_, err = l.LoadChunks(hs, (most+1)*4, [][]messages.BlockID{ids})
	require.ErrorIs(t, err, ErrTooLarge)
	require.ErrorIs(t, err, ErrBadLoad)
	require.Equal(t, messages.RejectTooLarge, messages.RejectLabel(err))
	_, err = l.LoadChunks(hs, math.MaxInt, [][]messages.BlockID{ids})
	require.ErrorIs(t, err, ErrTooLarge, "no overflow past the bound")
}

// LoadChunksAtMost refuses a load of more chunks than most, in all groups
// (needed chunks only: one of null blocks is not one), as too_large; the
// node's bound on an engine's loads in flight is in chunks.
func TestLoadChunksAtMostRefusesMoreChunks(t *testing.T) {
	l := hitLayout(t, messages.GroupSpec{Kind: "full", TokensPerBlock: 4})
	hs := hitHashes(4)
	chunks, err := l.LoadChunksAtMost(hs, 16, [][]messages.BlockID{{5, 0, 7, 8}}, 3)
	require.NoError(t, err, "three needed chunks of four")
	require.Len(t, chunks, 3)
	n, err := l.LoadChunkCount(hs, 16, [][]messages.BlockID{{5, 0, 7, 8}}, 3)
	require.NoError(t, err)
	require.Equal(t, 3, n, "counted as built")
	_, err = l.LoadChunksAtMost(hs, 16, [][]messages.BlockID{{5, 6, 7, 8}}, 3)
	require.ErrorIs(t, err, ErrTooManyChunks)
	require.ErrorIs(t, err, ErrBadLoad)
	require.Equal(t, messages.RejectTooLarge, messages.RejectLabel(err))
	_, err = l.LoadChunkCount(hs, 16, [][]messages.BlockID{{5, 6, 7, 8}}, 3)
	require.ErrorIs(t, err, ErrTooManyChunks, "refused as counted")
	_, err = l.LoadChunkCount(hs, 16, [][]messages.BlockID{{5, 6, 7, 99}}, 4)
	require.ErrorIs(t, err, ErrBlockRange, "checked as built")
}
