package sched

import (
	"math/rand"
	"reflect"
	"slices"
	"testing"
	"testing/quick"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

// groupCase is one random group with random request-level terms, for the
// quick checks of the group's own ready prefix and candidates.
type groupCase struct {
	kind     Kind
	tpc, hpc int // tokens and hashes per chunk
	bpc      int
	tokens   int
	hashes   int
	decoding bool
	blocks   []messages.BlockID // 0 is the null block
	cursor   messages.ChunkIndex
	redo     []messages.ChunkIndex
}

func (groupCase) Generate(rnd *rand.Rand, _ int) reflect.Value {
	c := groupCase{kind: []Kind{KindFull, KindSlidingWindow, KindEagle}[rnd.Intn(3)],
		hpc: 1 + rnd.Intn(3), bpc: 1 + rnd.Intn(3), tokens: rnd.Intn(200), hashes: rnd.Intn(40),
		decoding: rnd.Intn(2) == 0}
	c.tpc = c.hpc * (1 + rnd.Intn(8))
	c.blocks = make([]messages.BlockID, rnd.Intn(40))
	for i := range c.blocks {
		if rnd.Intn(4) > 0 { // a quarter null, as a sliding window or a skip leaves them
			c.blocks[i] = messages.BlockID(1 + rnd.Intn(63))
		}
	}
	complete := len(c.blocks) / c.bpc
	c.cursor = messages.ChunkIndex(rnd.Intn(complete + 1))
	for ch := range c.cursor {
		if rnd.Intn(3) == 0 {
			c.redo = append(c.redo, ch)
		}
	}
	return reflect.ValueOf(c)
}

func (c groupCase) group() (*group, *GroupLayout, readyTerms) {
	lay := &GroupLayout{Kind: c.kind, TokensPerChunk: c.tpc, HashesPerChunk: c.hpc}
	g := &group{blocks: c.blocks, cursor: c.cursor}
	for _, ch := range c.redo {
		g.addRedo(ch)
	}
	return g, lay, readyTerms{tokens: c.tokens, hashes: c.hashes, decoding: c.decoding, bpc: c.bpc}
}

// naiveReady is PROTOCOL.md's ready prefix recomputed plainly.
func (c groupCase) naiveReady() int {
	tok := c.tokens / c.tpc
	if c.kind == KindEagle && c.decoding {
		tok = max(tok-1, 0)
	}
	return min(tok, c.hashes/c.hpc, len(c.blocks)/c.bpc)
}

// TestGroupReadyIsNaive: the group's own O(1) ready prefix equals the naive
// min of the three terms, names a term that bounds it, and reports a deferral
// exactly when some term reaches past it.
func TestGroupReadyIsNaive(t *testing.T) {
	f := func(c groupCase) bool {
		g, lay, tm := c.group()
		rd, reason, best := g.ready(lay, tm)
		tok := c.tokens / c.tpc
		if c.kind == KindEagle && c.decoding {
			tok = max(tok-1, 0)
		}
		terms := map[DeferReason]int{DeferTokens: tok, DeferHashes: c.hashes / c.hpc,
			DeferBlocks: len(c.blocks) / c.bpc}
		if int(rd) != c.naiveReady() || terms[reason] != int(rd) {
			t.Logf("%+v: ready %d reason %v, naive %d", c, rd, reason, c.naiveReady())
			return false
		}
		return int(best) == max(terms[DeferTokens], terms[DeferHashes], terms[DeferBlocks])
	}
	if err := quick.Check(f, &quick.Config{MaxCount: 5000}); err != nil {
		t.Fatal(err)
	}
}

// TestGroupCandidatesAreNaive: the chunks a decision considers are the redo
// chunks below ready, then [cursor, ready), less those whose last block is
// null (PROTOCOL.md "block id 0") and, in a group that is not full
// attention, those with any null block (kvactors' choice, docs/PROTOCOL.md
// "block id 0"); stopping early stops the walk.
func TestGroupCandidatesAreNaive(t *testing.T) {
	f := func(c groupCase) bool {
		g, lay, tm := c.group()
		rd := messages.ChunkIndex(c.naiveReady())
		var want []messages.ChunkIndex
		notNull := func(ch messages.ChunkIndex) bool {
			for i := int(ch) * c.bpc; i < (int(ch)+1)*c.bpc; i++ {
				if c.blocks[i] == 0 && (i == (int(ch)+1)*c.bpc-1 || c.kind != KindFull) {
					return false
				}
			}
			return true
		}
		for _, ch := range c.redo {
			if ch < rd && notNull(ch) {
				want = append(want, ch)
			}
		}
		for ch := c.cursor; ch < rd; ch++ {
			if notNull(ch) {
				want = append(want, ch)
			}
		}
		got := slices.Collect(g.candidates(lay, rd, tm.bpc))
		if !slices.Equal(got, want) {
			t.Logf("%+v: candidates %v, naive %v", c, got, want)
			return false
		}
		n := 0
		for range g.candidates(lay, rd, tm.bpc) {
			n++
			break
		}
		return n == min(1, len(want))
	}
	if err := quick.Check(f, &quick.Config{MaxCount: 5000}); err != nil {
		t.Fatal(err)
	}
}

// addRedo holds each chunk once, in the order first added, across the
// buffer its list starts in and the growth past it.
func TestGroupAddRedoKeepsEachChunkOnceInOrder(t *testing.T) {
	rnd := rand.New(rand.NewSource(1))
	for range 500 {
		g := &group{}
		var want, added []messages.ChunkIndex
		for range rnd.Intn(24) {
			c := messages.ChunkIndex(rnd.Intn(16))
			added = append(added, c)
			g.addRedo(c)
			if !slices.Contains(want, c) {
				want = append(want, c)
			}
		}
		if !slices.Equal(nilIfEmpty(want), nilIfEmpty(g.redo())) {
			t.Fatalf("added %v: redo %v, want %v", added, g.redo(), want)
		}
	}
}

// A group's first redo list of up to a prefill step's chunks lives in its
// groupRetry: holding them costs that one allocation, not a list as well;
// one past the buffer grows.
func TestAGroupsFirstRedosLiveInItsRetry(t *testing.T) {
	cs := []messages.ChunkIndex{3, 4, 5, 6, 7, 8, 9, 10}
	allocs := testing.AllocsPerRun(100, func() {
		g := &group{}
		for _, c := range cs {
			g.addRedo(c)
		}
		if len(g.redo()) != len(cs) {
			t.Fatal("a redo lost")
		}
	})
	require.Equal(t, 1.0, allocs, "the groupRetry alone")
	g := &group{}
	for _, c := range append(slices.Clone(cs), 11) {
		g.addRedo(c)
	}
	require.Equal(t, append(slices.Clone(cs), 11), g.redo(), "past the buffer the list grows")
}
