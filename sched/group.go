package sched

import (
	"iter"

	"github.com/kvactors/kvactors/messages"
)

// group is one KV-cache group's store state within a request: its GPU block
// ids, its store cursor, the chunks to store again, and the last deferral
// reported. It computes its own ready prefix from the request-level terms
// (readyTerms) in O(1); the request's decision combines its groups' answers.
type group struct {
	lay    *GroupLayout
	blocks []messages.BlockID
	// cursor: chunks below it were decided (stored, deduplicated, or queued).
	// It never decreases (docs/PROTOCOL.md: "the cursor never decreases").
	cursor messages.ChunkIndex
	// redo holds chunks below cursor whose copy failed or was cancelled: they
	// are offered again once ready, so a failure never skips a chunk.
	redo []messages.ChunkIndex
	// keys caches the offload keys of chunks [cursor, cursor+len(keys)),
	// built while the pool has no room for them (retries reuse them); nil
	// once the cursor moves past them.
	keys []messages.Key
	// lastDefer is the deferral last reported, so each chunk's reason is
	// reported once per change.
	lastDefer Deferral
}

// readyTerms are the request-level inputs of every group's ready prefix
// (PROTOCOL.md, "ready prefix"), computed once per decision.
type readyTerms struct {
	tokens int // T, the offloadable tokens
	hashes int // hashes known
	// decoding: past the prompt and not finished, so an eagle group holds
	// back its trailing chunk.
	decoding bool
	bpc      int // blocks per chunk
}

// ready is the group's ready prefix with the term that bounds it: full
// chunks of offloadable tokens (an eagle group holds back its trailing chunk
// while decoding), complete tracked block chunks, and chunks whose key is
// known. best is the largest of the three terms: best > ready means something
// about chunk ready is known but not all of it (a deferral).
func (g *group) ready(tm readyTerms) (ready messages.ChunkIndex, reason DeferReason, best messages.ChunkIndex) {
	tok := tm.tokens / g.lay.TokensPerChunk
	if g.lay.Kind == KindEagle && tm.decoding {
		tok = max(tok-1, 0)
	}
	hsh := tm.hashes / g.lay.HashesPerChunk
	blk := len(g.blocks) / tm.bpc
	rd, reason := tok, DeferTokens
	if hsh < rd {
		rd, reason = hsh, DeferHashes
	}
	if blk < rd {
		rd, reason = blk, DeferBlocks
	}
	return messages.ChunkIndex(rd), reason, messages.ChunkIndex(max(tok, hsh, blk))
}

// candidates yields the chunks a decision at ready prefix rd considers:
// redo chunks below rd, then [cursor, rd), each only if its last block is
// not null (docs/PROTOCOL.md: "whose last block id is not 0").
func (g *group) candidates(rd messages.ChunkIndex, bpc int) iter.Seq[messages.ChunkIndex] {
	return func(yield func(messages.ChunkIndex) bool) {
		for _, c := range g.redo {
			if c < rd && g.lastBlock(c, bpc) != 0 && !yield(c) {
				return
			}
		}
		for c := g.cursor; c < rd; c++ {
			if g.lastBlock(c, bpc) != 0 && !yield(c) {
				return
			}
		}
	}
}

// lastBlock is the last block id of chunk c (which must be complete).
func (g *group) lastBlock(c messages.ChunkIndex, bpc int) messages.BlockID {
	return g.blocks[(int(c)+1)*bpc-1]
}

// chunkBlocks appends chunk c's block ids (nulls included) to dst.
func (g *group) chunkBlocks(c messages.ChunkIndex, bpc int, dst []messages.BlockID) []messages.BlockID {
	return append(dst, g.blocks[int(c)*bpc:(int(c)+1)*bpc]...)
}

func (g *group) addRedo(c messages.ChunkIndex) {
	for _, x := range g.redo {
		if x == c {
			return
		}
	}
	g.redo = append(g.redo, c)
}

// applyBlocks appends ids at start: the overlap must agree, a start past the
// known length is a hole. It validates before mutating.
func (g *group) applyBlocks(start int, ids []messages.BlockID, numBlocks int) error {
	n := len(g.blocks)
	if start > n {
		return ErrHole
	}
	for i, id := range ids {
		if int(id) >= numBlocks {
			return ErrBlockRange
		}
		if start+i < n && g.blocks[start+i] != id {
			return ErrConflict
		}
	}
	if end := start + len(ids); end > n {
		g.blocks = append(g.blocks, ids[n-start:]...)
	}
	return nil
}

// dropKeys empties the key cache; a small one keeps its capacity for the
// next decision (a decode step caches one key), a prefill's is freed.
func (g *group) dropKeys() {
	if cap(g.keys) > 8 {
		g.keys = nil
		return
	}
	clear(g.keys)
	g.keys = g.keys[:0]
}
