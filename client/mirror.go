package client

import (
	"slices"

	"github.com/kvactors/kvactors/wire"
)

// phase is where a request is, as the engine last said.
type phase uint8

const (
	running   phase = iota // added or resumed
	preempted              // preempted, not resumed
	finished               // finished or aborted
)

// mreq mirrors one live request: what a resync re-announces.
type mreq struct {
	id     string
	n      uint64 // arrival order, so a resync re-announces in a stable order
	prompt int
	// maxOffload is max_offload_tokens, -1 when unset.
	maxOffload int
	hashes     [][]byte
	blocks     [][]uint32 // per group
	// Last tokens (or finished) event.
	computed, total int
	hasTokens       bool
	phase           phase
	aborted         bool
	// owed: releases the engine waits for (a preemption not yet released
	// may be followed by a resume and a finish: two).
	owed int
	// finPre: finished while preempted. The finish gives up no block: the
	// mirrored blocks go back to the engine with the preemption's release,
	// the one before the finish's (blocksBackAt).
	finPre bool
	// Tokens as of the preemption (the blocks it gives up hold that KV);
	// postTok: a tokens event came after it (it describes blocks to come).
	preComputed, preTotal int
	preHasTokens, postTok bool
	// silent: a release is due from the node that the engine does not wait
	// for (a preempted request re-announced after its blocks were freed).
	silent bool
	// atNode: the node may hold the request: an event of it was published
	// (not only put in a batch then dropped unsent) since the engine last
	// registered, and no engine_gone released it since. Without it, while the node has forgotten the
	// engine, the node can copy nothing of it (freeIfNoNodeLocked).
	atNode bool
}

func (r *mreq) addHashes(start int, hs [][]byte) {
	if start > len(r.hashes) {
		return // a hole: the node rejects it too; the mirror keeps what it knows
	}
	for i := len(r.hashes) - start; i < len(hs); i++ {
		r.hashes = append(r.hashes, slices.Clone(hs[i]))
	}
}

func (r *mreq) addBlocks(g, start int, ids []uint32) {
	if g < 0 || g >= len(r.blocks) || start > len(r.blocks[g]) {
		return
	}
	if skip := len(r.blocks[g]) - start; skip < len(ids) {
		r.blocks[g] = append(r.blocks[g], ids[skip:]...)
	}
}

// blocksBackAt is the owed count at which the mirrored blocks of a
// preempted or finished request are the engine's again: when the release
// of the event that gave them up arrives. That is the last owed one, or
// for a request finished while preempted the one before it. Earlier owed
// releases answer preemptions whose blocks a resume already dropped from
// the mirror, so they free nothing mirrored.
func (r *mreq) blocksBackAt() int {
	if r.finPre {
		return 1
	}
	return 0
}

func (r *mreq) clearBlocks() {
	for g := range r.blocks {
		r.blocks[g] = nil
	}
}

// Bounds on one re-announced event, so a long request splits into several
// events rather than one huge one.
const (
	announceHashes = 1024
	announceIDs    = 4096
)

// announce appends r's state as ordinary events (PROTOCOL.md "Resync"):
// added, hashes from 0, blocks from 0 per group, tokens, then preempted or
// finished if it is in that phase. flush is called between events, so the
// caller can publish the batch once it is big enough (b.Len).
//
// The rule that keeps reuse safe: the node releases a preempted with no
// block tracked at once, and each release hands the engine back the blocks
// of the event it answers. So blocks the engine will get back with an owed
// release are named only before the preempted or finished whose release
// that is, never after an earlier owed one:
//   - owed releases of preemptions a resume already answered in the
//     mirror (their blocks are dropped) become a block-less preempted +
//     resumed each, first, each released at once;
//   - a request finished while preempted, whose preemption's release is
//     still owed, is blocks, preempted, finished: its blocks go back with
//     that preempted's release, after which the node tracks none of them
//     (finished of a preempted request forgets its block ids); once that
//     release came, its blocks are dropped (blocksBackAt) and only the
//     finished remains.
func (r *mreq) announce(b *wire.Batch, flush func()) {
	appendAdded(b, r.id, r.prompt, r.maxOffload)
	for s := 0; s < len(r.hashes); s += announceHashes {
		hs := r.hashes[s:min(s+announceHashes, len(r.hashes))]
		b.BeginHashes(r.id, s)
		for _, h := range hs {
			b.Hash(h)
		}
		b.EndHashes()
		flush()
	}
	// How many owed releases the closing events below answer.
	closing := 0
	preThenFin := r.phase == finished && r.finPre && r.owed >= 2
	switch {
	case preThenFin:
		closing = 2
	case r.phase != running:
		closing = 1
	}
	for range r.owed - closing {
		b.Preempted(r.id)
		b.Resumed(r.id)
	}
	// A preempted request that owes nothing has given its blocks back.
	if r.phase != preempted || r.owed > 0 {
		for g, ids := range r.blocks {
			for s := 0; s < len(ids); s += announceIDs {
				part := ids[s:min(s+announceIDs, len(ids))]
				b.Blocks(r.id, g, s, part)
				flush()
			}
		}
	}
	switch {
	case r.phase == running:
		if r.hasTokens {
			b.Tokens(r.id, r.computed, r.total)
		}
	case r.phase == preempted || preThenFin:
		// The KV the given-up blocks hold, then (the node zeroes computed at
		// preempted) what came after, as the engine said it.
		if r.preHasTokens {
			b.Tokens(r.id, r.preComputed, r.preTotal)
		}
		b.Preempted(r.id)
		if r.phase == preempted && r.postTok {
			b.Tokens(r.id, r.computed, r.total)
		}
	}
	if r.phase == finished {
		b.Finished(r.id, r.aborted, r.computed, r.total)
	}
	flush()
}
