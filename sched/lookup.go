package sched

import (
	"errors"
	"fmt"

	"github.com/kvactors/kvactors/messages"
)

// ErrBadLoad wraps every reason a load body does not fit the layout.
var ErrBadLoad = errors.New("bad load")

// HitTokens answers P.E.lookup (PROTOCOL.md): for each full-attention group,
// the leading chunks whose keys are ready (stop at the first miss or pending
// key) times its tokens_per_chunk; the hit is the minimum over those groups.
//
// The other kinds must back the same prefix, by kvactors' rule
// (docs/PROTOCOL.md, "lookup"): an eagle group (a draft model's full
// attention) needs every chunk below the hit; a sliding-window group needs
// only the chunks overlapping the last sliding_window tokens before the hit
// (earlier ones were null blocks, never stored). When they do not, the hit
// steps down a full chunk at a time until they do.
func (l *Layout) HitTokens(hashes []messages.Hash, ready func(messages.Key) bool) int {
	hit, step := -1, 0
	for g, gl := range l.Groups {
		if gl.Kind != KindFull {
			continue
		}
		n := 0
		for ; (n+1)*gl.HashesPerChunk <= len(hashes); n++ {
			if !ready(l.Key(hashes[(n+1)*gl.HashesPerChunk-1], g)) {
				break
			}
		}
		if t := n * gl.TokensPerChunk; hit < 0 || t < hit {
			hit = t
		}
		step = max(step, gl.TokensPerChunk)
	}
	if hit <= 0 {
		return 0 // no full-attention group, or no hit
	}
	for ; hit > 0; hit -= min(step, hit) {
		if l.othersBack(hit, hashes, ready) {
			return hit
		}
	}
	return 0
}

// othersBack reports whether the non-full groups hold what a hit of t tokens
// needs.
func (l *Layout) othersBack(t int, hashes []messages.Hash, ready func(messages.Key) bool) bool {
	for g, gl := range l.Groups {
		if gl.Kind == KindFull {
			continue
		}
		end := t / gl.TokensPerChunk
		first := 0
		if gl.Kind == KindSlidingWindow {
			first = max(0, t-gl.SlidingWindow) / gl.TokensPerChunk
		}
		for c := first; c < end; c++ {
			i := (c+1)*gl.HashesPerChunk - 1
			if i >= len(hashes) || !ready(l.Key(hashes[i], g)) {
				return false
			}
		}
	}
	return true
}

// LoadChunks turns a P.E.load body into the chunks to copy: for every group
// g, chunks [0, numTokens / tokens_per_chunk[g]) into blocks[g] (bpc ids per
// chunk; id 0 is not needed and skipped; a chunk with no needed block is
// left out). Slots are filled in by the caller from the pool.
func (l *Layout) LoadChunks(hashes []messages.Hash, numTokens int, blocks [][]messages.BlockID) ([]JobChunk, error) {
	if len(blocks) != len(l.Groups) {
		return nil, fmt.Errorf("%w: %d block lists for %d groups", ErrBadLoad, len(blocks), len(l.Groups))
	}
	bpc := l.BlocksPerChunk
	var out []JobChunk
	for g, gl := range l.Groups {
		n := numTokens / gl.TokensPerChunk
		if len(blocks[g]) < n*bpc {
			return nil, fmt.Errorf("%w: group %d: %d block ids for %d chunks of %d blocks", ErrBadLoad, g,
				len(blocks[g]), n, bpc)
		}
		if n*gl.HashesPerChunk > len(hashes) {
			return nil, fmt.Errorf("%w: %d tokens need %d hashes, got %d", ErrBadLoad, numTokens,
				n*gl.HashesPerChunk, len(hashes))
		}
		for c := range n {
			ids := blocks[g][c*bpc : (c+1)*bpc]
			needed := false
			for _, id := range ids {
				if int(id) >= l.NumGPUBlocks {
					return nil, fmt.Errorf("%w: group %d: block id %d >= num_gpu_blocks %d", ErrBadLoad, g, id, l.NumGPUBlocks)
				}
				needed = needed || id != 0
			}
			if !needed {
				continue
			}
			out = append(out, JobChunk{Group: g, Index: messages.ChunkIndex(c),
				Key: l.Key(hashes[(c+1)*gl.HashesPerChunk-1], g), Blocks: append([]messages.BlockID(nil), ids...)})
		}
	}
	return out, nil
}
