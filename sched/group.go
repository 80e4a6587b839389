package sched

import (
	"iter"
	"math"
	"slices"

	"github.com/kvactors/kvactors/messages"
)

// group is one KV-cache group's store state within a request: its GPU block
// ids, its store cursor, the last deferral reported, and (rarely) chunks to
// store again. It computes its own ready prefix from its layout and the
// request-level terms (readyTerms) in O(1); the request's decision combines
// its groups' answers. Every live request holds one per group, so it is kept
// small: its layout is the request's, its index is its place in the request.
type group struct {
	blocks []messages.BlockID
	// cursor: chunks below it were decided (stored, deduplicated, or queued).
	// It never decreases (docs/PROTOCOL.md: "the cursor never decreases").
	cursor messages.ChunkIndex
	// retry holds what chunks waiting on the pool need; nil while none
	// does (most groups never retry).
	retry *groupRetry
	// lastDefer is the deferral last reported, so each chunk's reason is
	// reported once per change.
	lastDefer deferNote
}

// deferNote is a group's last reported deferral. A chunk index fits in
// int32: chunks are below MaxBlocks, which ceilDiv caps at MaxInt32.
type deferNote struct {
	chunk  int32 // -1: none yet
	reason DeferReason
}

// groupRetry is a group's state for chunks that wait on the pool.
type groupRetry struct {
	// redo holds chunks below cursor whose copy failed or was cancelled, or
	// whose key was pending in another copy: they are offered again once
	// ready, so a failure never skips a chunk.
	redo []messages.ChunkIndex
	// keys caches the offload keys of chunks [cursor, cursor+len(keys)),
	// built by a decision the pool had no room for: while it has none,
	// every event retries the same chunks, and their keys are built once.
	keys []messages.Key
	// redoBuf is redo's first backing (retryState): a decision that meets
	// a prefill step's keys pending in another copy holds up to a step's
	// chunks, and a list of their own cost allocations as it grew.
	redoBuf [8]messages.ChunkIndex
}

func (g *group) redo() []messages.ChunkIndex {
	if g.retry == nil {
		return nil
	}
	return g.retry.redo
}

func (g *group) cachedKeys() []messages.Key {
	if g.retry == nil {
		return nil
	}
	return g.retry.keys
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
func (g *group) ready(gl *GroupLayout, tm readyTerms) (ready messages.ChunkIndex, reason DeferReason, best messages.ChunkIndex) {
	tok := tm.tokens / gl.TokensPerChunk
	if gl.Kind == KindEagle && tm.decoding {
		tok = max(tok-1, 0)
	}
	hsh := tm.hashes / gl.HashesPerChunk
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
// redo chunks below rd, then [cursor, rd), each only if it is storable.
func (g *group) candidates(gl *GroupLayout, rd messages.ChunkIndex, bpc int) iter.Seq[messages.ChunkIndex] {
	return func(yield func(messages.ChunkIndex) bool) {
		for _, c := range g.redo() {
			if c < rd && g.storable(gl, c, bpc) && !yield(c) {
				return
			}
		}
		for c := g.cursor; c < rd; c++ {
			if g.storable(gl, c, bpc) && !yield(c) {
				return
			}
		}
	}
}

// storable reports whether chunk c (which must be complete) may be stored.
// PROTOCOL.md: not if its last block id is 0. kvactors' choice
// (docs/PROTOCOL.md, "block id 0"): in a group that is not full attention,
// not if any of its block ids is 0. Such a chunk's host copy would hold
// zeros in places the lookup rule for those kinds counts as present
// (docs/PROTOCOL.md, "lookup"), a load would copy them into blocks the
// engine needs, and dedup would keep a later whole copy out.
func (g *group) storable(gl *GroupLayout, c messages.ChunkIndex, bpc int) bool {
	ids := g.blocks[int(c)*bpc : (int(c)+1)*bpc]
	if gl.Kind == KindFull {
		return ids[bpc-1] != 0
	}
	return !slices.Contains(ids, 0)
}

// chunkIDs is chunk c's block ids (nulls included), aliasing the group's
// own: a store job reads them while its copy runs, and nothing writes them
// after. An id once known is never changed (checkBlocks refuses a
// conflict and only appends past the end, which the slice's capacity
// excludes), and clearBlocks moves the group to a fresh array.
func (g *group) chunkIDs(c messages.ChunkIndex, bpc int) []messages.BlockID {
	lo, hi := int(c)*bpc, (int(c)+1)*bpc
	return g.blocks[lo:hi:hi]
}

// addRedo holds chunk c for the next decision that finds it ready (once).
func (g *group) addRedo(c messages.ChunkIndex) {
	r := g.retryState()
	if !slices.Contains(r.redo, c) {
		r.redo = append(r.redo, c)
	}
}

// retryState is the group's groupRetry, made on first need.
func (g *group) retryState() *groupRetry {
	if g.retry == nil {
		g.retry = &groupRetry{}
		g.retry.redo = g.retry.redoBuf[:0]
	}
	return g.retry
}

// cacheKeys extends the key cache with the keys of the chunks after it;
// own: as copies (appendOwn), not the strings keys share with others.
func (g *group) cacheKeys(keys []messages.Key, own bool) {
	if len(keys) == 0 {
		return
	}
	r := g.retryState()
	// Grown by keysCap, which Request.cacheKeys charged for: a prefill that
	// waits on a full pool extends the cache at each step, and copying it
	// whole each time would cost the square of its length.
	if c := keysCap(r.keys, len(keys)); c > cap(r.keys) {
		r.keys = append(make([]messages.Key, 0, c), r.keys...)
	}
	if own {
		r.keys = appendOwn(r.keys, keys, bytesOf(keys))
		return
	}
	r.keys = append(r.keys, keys...)
}

// keysCap is the capacity a key cache takes to hold k more keys: its own
// while they fit, else as append grows it (exactly them when empty).
func keysCap(cached []messages.Key, k int) int {
	end := len(cached) + k
	if end <= cap(cached) {
		return cap(cached)
	}
	return grownCap(cap(cached), end, 0, math.MaxInt, false)
}

// decided follows a decision that moved the cursor to it: redo chunks below
// rd were offered again, and every cached key is below the cursor.
func (g *group) decided(rd messages.ChunkIndex) {
	g.cursor = max(g.cursor, rd)
	if g.retry == nil {
		return
	}
	g.retry.keys = nil
	g.retry.redo = slices.DeleteFunc(g.retry.redo, func(c messages.ChunkIndex) bool { return c < rd })
	if len(g.retry.redo) == 0 {
		g.retry = nil
	}
}

// checkBlocks validates ids at start before anything changes: the overlap
// must agree, a start past the known length is a hole, and every id is
// below numBlocks (Request.applyBlocks appends them).
func (g *group) checkBlocks(start int, ids []messages.BlockID, numBlocks int) error {
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
	return nil
}
