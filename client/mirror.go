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
	// silent: a release is due from the node that the engine does not wait
	// for (a preempted request re-announced after its blocks were freed).
	silent bool
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
// finished if it is in that phase. flush is called between events with
// about how many bytes were appended, so the caller can publish the batch
// once it is big enough.
func (r *mreq) announce(b *wire.Batch, flush func(bytes int)) {
	const event = 64 + 256 // envelope of one event plus the longest request id
	appendAdded(b, r.id, r.prompt, r.maxOffload)
	for s := 0; s < len(r.hashes); s += announceHashes {
		hs := r.hashes[s:min(s+announceHashes, len(r.hashes))]
		b.BeginHashes(r.id, s)
		n := event
		for _, h := range hs {
			b.Hash(h)
			n += 2*len(h) + 3
		}
		b.EndHashes()
		flush(n)
	}
	extra := r.owed
	if r.phase != running {
		extra-- // the phase event below answers one
	}
	for range extra {
		// Resumed while a release for the preemption was still due: the old
		// blocks are gone from the mirror, so a preemption with none tracked
		// (released at once) answers that wait, then the fresh blocks follow.
		b.Preempted(r.id)
		b.Resumed(r.id)
	}
	announceBlocks := r.phase != preempted || r.owed > 0
	for g, ids := range r.blocks {
		if !announceBlocks {
			break
		}
		for s := 0; s < len(ids); s += announceIDs {
			part := ids[s:min(s+announceIDs, len(ids))]
			b.Blocks(r.id, g, s, part)
			flush(event + 11*len(part))
		}
	}
	if r.hasTokens && r.phase != finished {
		b.Tokens(r.id, r.computed, r.total)
	}
	switch r.phase {
	case preempted:
		b.Preempted(r.id)
	case finished:
		b.Finished(r.id, r.aborted, r.computed, r.total)
	}
	flush(4 * event)
}
