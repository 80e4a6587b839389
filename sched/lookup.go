package sched

import (
	"fmt"
	"math"

	"github.com/kvactors/kvactors/messages"
)

// ErrBadLoad wraps every reason a load body does not fit the layout; it
// counts as malformed (a block id past num_gpu_blocks as block_range).
var ErrBadLoad = messages.NewRejection(messages.RejectMalformed, "bad load")

// ErrTooManyChunks: a load would copy more chunks than the node lets one
// load (LoadChunksAtMost).
var ErrTooManyChunks = messages.NewRejection(messages.RejectTooLarge, "more chunks than one load may copy")

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
//
// The lookup runs on the engine's intake shard and each ready call takes
// the pool's lock, so it asks about each chunk of each group at most once,
// O(len(hashes)) calls in all, however far the hit steps down (backer).
func (l *Layout) HitTokens(hashes []messages.Hash, ready func(messages.Key) bool) int {
	hit, step := -1, 0
	var others []backer
	for g, gl := range l.Groups {
		if gl.Kind != KindFull {
			others = append(others, backer{l: l, g: g, top: -1, first: -1})
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
		backed := true
		for i := range others {
			if !others[i].backs(hit, hashes, ready) {
				backed = false
				break
			}
		}
		if backed {
			return hit
		}
	}
	return 0
}

// backer answers, for one group that is not full attention, whether it holds
// what a hit of t tokens needs, for t that only decrease from call to call.
// It asks ready about each chunk at most once.
type backer struct {
	l *Layout
	g int
	// eagle: chunks [0, first) are ready, and chunk first is not or is the
	// end first asked about (-1: not looked for yet).
	first int
	// sliding window: chunks [lo, top) were asked about (top -1: none yet);
	// suf[k] counts the misses among [top-k, top).
	lo, top int
	suf     []int32
}

// has reports whether chunk c of the group is ready (its hash known).
func (b *backer) has(c int, hashes []messages.Hash, ready func(messages.Key) bool) bool {
	i := (c+1)*b.l.Groups[b.g].HashesPerChunk - 1
	return i < len(hashes) && ready(b.l.Key(hashes[i], b.g))
}

// backs reports whether the group holds what a hit of t tokens needs
// (docs/PROTOCOL.md "lookup"): an eagle group every chunk
// below t, a sliding-window group the chunks overlapping [t-window, t).
func (b *backer) backs(t int, hashes []messages.Hash, ready func(messages.Key) bool) bool {
	gl := &b.l.Groups[b.g]
	end := t / gl.TokensPerChunk
	if gl.Kind != KindSlidingWindow { // eagle: every chunk below end
		if b.first < 0 { // end is the largest asked about: look for the first miss below it
			b.first = 0
			for b.first < end && b.has(b.first, hashes, ready) {
				b.first++
			}
		}
		return end <= b.first
	}
	first := max(0, t-gl.SlidingWindow) / gl.TokensPerChunk
	if first >= end {
		return true
	}
	if b.top < 0 || end <= b.lo { // nothing asked about overlaps [first, end), nor will later windows
		b.top, b.lo, b.suf = end, end, append(b.suf[:0], 0)
	}
	misses := func(lo, hi int) int32 { return b.suf[b.top-lo] - b.suf[b.top-hi] } // in [lo, hi) ⊆ [b.lo, b.top)
	if misses(max(b.lo, first), end) > 0 {
		return false
	}
	for b.lo > first {
		b.lo--
		n := b.suf[len(b.suf)-1]
		if !b.has(b.lo, hashes, ready) {
			b.suf = append(b.suf, n+1)
			return false // the miss at lo lies in [first, end)
		}
		b.suf = append(b.suf, n)
	}
	return true
}

// LoadChunks turns a P.E.load body into the chunks to copy: for every group
// g, chunks [0, numTokens / tokens_per_chunk[g]) into blocks[g] (bpc ids per
// chunk; id 0 is not needed and skipped; a chunk with no needed block is
// left out). Slots are filled in by the caller from the pool.
func (l *Layout) LoadChunks(hashes []messages.Hash, numTokens int, blocks [][]messages.BlockID) ([]JobChunk, error) {
	return l.LoadChunksAtMost(hashes, numTokens, blocks, math.MaxInt)
}

// LoadChunksAtMost is LoadChunks refusing, with ErrTooManyChunks, a load of
// more than most chunks in all groups, before it holds their memory (each
// chunk of a job costs ~150 bytes of heap, and a load may name one chunk
// again and again): it counts them first (LoadChunkCount).
func (l *Layout) LoadChunksAtMost(hashes []messages.Hash, numTokens int, blocks [][]messages.BlockID,
	most int) ([]JobChunk, error) {
	n, err := l.LoadChunkCount(hashes, numTokens, blocks, most)
	if err != nil {
		return nil, err
	}
	return l.LoadChunksCounted(hashes, numTokens, blocks, n)
}

// LoadChunksCounted builds the n chunks LoadChunkCount counted in the same
// body, in one walk, holding exactly their memory (a body with more is
// refused, as LoadChunksAtMost refuses it).
func (l *Layout) LoadChunksCounted(hashes []messages.Hash, numTokens int, blocks [][]messages.BlockID,
	n int) ([]JobChunk, error) {
	out := make([]JobChunk, 0, n)
	_, err := l.loadChunks(hashes, numTokens, blocks, n, func(g, c int, ids []messages.BlockID) {
		gl := l.Groups[g]
		out = append(out, JobChunk{Group: g, Index: messages.ChunkIndex(c),
			Key: l.Key(hashes[(c+1)*gl.HashesPerChunk-1], g), Blocks: append([]messages.BlockID(nil), ids...)})
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// LoadChunkCount is how many chunks LoadChunksAtMost would build, and its
// error, without building any: a node counts a load's chunks against its
// engine's room before it holds their memory.
func (l *Layout) LoadChunkCount(hashes []messages.Hash, numTokens int, blocks [][]messages.BlockID,
	most int) (int, error) {
	return l.loadChunks(hashes, numTokens, blocks, most, nil)
}

// loadChunks checks a load body against the layout and calls chunk (if
// not nil) for each chunk to copy, in order: of group g, chunk c, into
// ids; it returns how many, refusing more than most.
func (l *Layout) loadChunks(hashes []messages.Hash, numTokens int, blocks [][]messages.BlockID, most int,
	chunk func(g, c int, ids []messages.BlockID)) (int, error) {
	if len(blocks) != len(l.Groups) {
		return 0, fmt.Errorf("%w: %d block lists for %d groups", ErrBadLoad, len(blocks), len(l.Groups))
	}
	bpc := l.BlocksPerChunk
	count := 0
	for g, gl := range l.Groups {
		n := numTokens / gl.TokensPerChunk
		if n > gl.MaxBlocks/bpc {
			// A request holds no more (max_model_len, --max-model-len; else
			// the engine's num_gpu_blocks): past it a load only repeats
			// chunks, and one load of any size runs alone in the copy queue
			// while every engine's copies wait.
			return 0, fmt.Errorf("%w: %w: group %d: %d tokens need %d chunks, a request holds at most %d",
				ErrTooLarge, ErrBadLoad, g, numTokens, n, gl.MaxBlocks/bpc)
		}
		if len(blocks[g]) < n*bpc {
			return 0, fmt.Errorf("%w: group %d: %d block ids for %d chunks of %d blocks", ErrBadLoad, g,
				len(blocks[g]), n, bpc)
		}
		if n*gl.HashesPerChunk > len(hashes) {
			return 0, fmt.Errorf("%w: %d tokens need %d hashes, got %d", ErrBadLoad, numTokens,
				n*gl.HashesPerChunk, len(hashes))
		}
		for c := range n {
			ids := blocks[g][c*bpc : (c+1)*bpc]
			needed := false
			for _, id := range ids {
				if int(id) >= l.NumGPUBlocks {
					return 0, fmt.Errorf("%w: %w: group %d: block id %d >= num_gpu_blocks %d", ErrBadLoad, ErrBlockRange,
						g, id, l.NumGPUBlocks)
				}
				needed = needed || id != 0
			}
			if !needed {
				continue
			}
			if count == most {
				return 0, fmt.Errorf("%w: %w: more than %d chunks", ErrTooManyChunks, ErrBadLoad, most)
			}
			count++
			if chunk != nil {
				chunk(g, c, ids)
			}
		}
	}
	return count, nil
}
