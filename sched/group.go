package sched

import "github.com/kvactors/kvactors/messages"

// group is one KV-cache group's store state within a request: its GPU block
// ids, its store cursor, the chunks to store again, and the last deferral
// reported. The request-level terms of the ready prefix (tokens, hashes) live
// in Request; readiness is computed there in O(1) per group.
type group struct {
	lay    *GroupLayout
	blocks []messages.BlockID
	// cursor: chunks below it were decided (stored, deduplicated, or queued).
	// It never decreases (PROTOCOL.md: "The cursor never decreases").
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
